"""The `--engine openai` job's HTTP side: chat completion requests spread over the
endpoints (`aiohttp`, one event loop), at most ``concurrency`` in flight on each,
the least loaded live endpoint taking the next one.

What goes wrong, and what happens:

* a connection that fails or breaks (refused, reset, the server died mid-reply) or
  a request that times out: the endpoint is probed (``/v1/models``); one that does
  not answer is *down* for the rest of the run and the request goes to another,
  not counted against the record. With no endpoint left, `EndpointsDown`: the job
  stops, committed shards kept.
* a timeout or an HTTP error from a live server: retried ``retries`` times with
  exponential backoff (HTTP 4xx other than 408/429 are the request's own fault and
  are not retried), then `RequestFailed`, and the record is quarantined with the
  reason (``request_timeout``, ``http_<status>``) and the server's message."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import EndpointsDown, RequestFailed

if TYPE_CHECKING:  # aiohttp only for the OpenAI-compatible client
    import aiohttp

RETRIED_STATUSES = {408, 429}  # and every 5xx
BACKOFF_SECONDS, BACKOFF_CAP = 0.5, 30.0
PROBE_SECONDS = 10.0


@dataclass(frozen=True)
class Completion:
    """What one chat completion came back with."""

    text: str  # the message's content (reasoning a server parsed out is put back by `replies.raw_text`)
    reasoning: str | None  # reasoning_content / reasoning, where the server splits it off
    token_ids: list[int] | None  # the generated ids, where the server returns them (vLLM: return_token_ids)
    prompt_token_ids: list[int] | None
    finish_reason: str
    has_tool_calls: bool
    endpoint: str


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class EndpointPool:
    """The endpoints of one job and their load, on one event loop."""

    def __init__(self, served: list, concurrency: int, timeout: float, retries: int, log=print):
        self.models = {s.endpoint: s.model for s in served}
        self.load = {s.endpoint: 0 for s in served}
        self.down: dict[str, str] = {}  # endpoint -> why
        self.concurrency, self.timeout, self.retries, self.log = concurrency, timeout, retries, log
        self.retried = 0  # tries that failed and were tried again
        self.rerouted = 0  # requests moved off an endpoint that went down
        self._free = asyncio.Condition()
        self._session: aiohttp.ClientSession | None = None  # open inside `async with`

    async def __aenter__(self):
        import aiohttp  # --engine openai only

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the OpenAI client is used outside `async with`")
        return self._session

    async def chat(self, body: dict) -> Completion:
        """One chat completion (`body` without ``model``), on whichever endpoint is free."""
        failures = 0
        while True:
            endpoint = await self._acquire()
            try:
                return await self._post(endpoint, body)
            except (asyncio.TimeoutError, _HTTPError, OSError, _client_errors()) as error:
                reason, detail = _describe(error, self.timeout)
                if not isinstance(error, _HTTPError) and not await self._answers(endpoint):
                    await self._mark_down(endpoint, detail)
                    self.rerouted += 1
                    continue
                if isinstance(error, _HTTPError) and error.status < 500 and error.status not in RETRIED_STATUSES:
                    raise RequestFailed(reason, detail) from None
                failures += 1
                if failures > self.retries:
                    raise RequestFailed(reason, f"{detail} (after {failures} tries)") from None
                self.retried += 1
            finally:
                await self._release(endpoint)
            await asyncio.sleep(min(BACKOFF_CAP, BACKOFF_SECONDS * 2 ** (failures - 1)))

    async def _acquire(self) -> str:
        async with self._free:
            while True:
                live = [e for e in self.load if e not in self.down]
                if not live:
                    why = "; ".join(f"{e}: {reason}" for e, reason in self.down.items())
                    raise EndpointsDown(f"every endpoint is down ({why})")
                free = [e for e in live if self.load[e] < self.concurrency]
                if free:
                    endpoint = min(free, key=lambda e: self.load[e])
                    self.load[endpoint] += 1
                    return endpoint
                await self._free.wait()

    async def _release(self, endpoint: str) -> None:
        async with self._free:
            self.load[endpoint] -= 1
            self._free.notify_all()

    async def _mark_down(self, endpoint: str, why: str) -> None:
        async with self._free:
            if endpoint not in self.down:
                self.down[endpoint] = why
                left = len(self.load) - len(self.down)
                self.log(
                    f"endpoint {endpoint} is down ({why}); its requests go to the other {left} endpoint(s)"
                    if left
                    else f"endpoint {endpoint} is down ({why}); no endpoint left"
                )
            self._free.notify_all()

    async def _answers(self, endpoint: str) -> bool:
        import aiohttp  # aiohttp only for the OpenAI-compatible client

        if endpoint in self.down:
            return False
        try:
            async with self.session.get(
                f"{endpoint}/v1/models", timeout=aiohttp.ClientTimeout(total=PROBE_SECONDS)
            ) as response:
                return response.status == 200
        except (asyncio.TimeoutError, OSError, aiohttp.ClientError):
            return False

    async def _post(self, endpoint: str, body: dict) -> Completion:
        import aiohttp  # aiohttp only for the OpenAI-compatible client

        payload = dict(body, model=self.models[endpoint])
        async with self.session.post(
            f"{endpoint}/v1/chat/completions", json=payload, timeout=aiohttp.ClientTimeout(total=self.timeout)
        ) as response:
            text = await response.text()
            if response.status != 200:
                raise _HTTPError(response.status, _error_message(text))
        return parse_completion(json.loads(text), endpoint)


def parse_completion(reply: dict, endpoint: str) -> Completion:
    choice = reply["choices"][0]
    message = choice.get("message") or {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    prompt_ids = reply.get("prompt_token_ids", choice.get("prompt_token_ids"))
    return Completion(
        text=message.get("content") or "",
        reasoning=reasoning or None,
        token_ids=choice.get("token_ids"),
        prompt_token_ids=prompt_ids,
        finish_reason=str(choice.get("finish_reason")),
        has_tool_calls=bool(message.get("tool_calls")),
        endpoint=endpoint,
    )


def _client_errors() -> type[Exception]:
    import aiohttp  # aiohttp only for the OpenAI-compatible client

    return aiohttp.ClientError


def _describe(error: BaseException, timeout: float) -> tuple[str, str]:
    """(quarantine reason, one-line detail) of a failed try."""
    if isinstance(error, _HTTPError):
        return f"http_{error.status}", str(error)
    if isinstance(error, asyncio.TimeoutError):
        return "request_timeout", f"no reply within --request-timeout {timeout:g} s"
    return "connection_error", " ".join(f"{type(error).__name__}: {error}".split())[:300]


def _error_message(text: str) -> str:
    """The server's own error message, one line (vLLM / SGLang / OpenAI shapes)."""
    try:
        body = json.loads(text)
    except ValueError:
        return " ".join(text.split())[:300]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return " ".join(str(message).split())[:300]
