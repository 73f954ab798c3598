"""The OpenAI-compatible servers of an `--engine openai` job, checked before any
generation request: each endpoint answers, serves the job's ``--model`` (its name,
and where the server can say, its tokenizer and chat template: ``/tokenize`` of a
probe conversation), leaves room for ``--max-length``, and all of them are one
server build (``/v1/models`` ``owned_by``, ``/version``), recorded in the manifest.

Every refusal is one line naming the endpoint and what is wrong; nothing is written."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExtractError
from .turns import render_prompt

PROBE_TIMEOUT = 15.0  # seconds for a start-up check
PROBE_CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write a function that adds two numbers."},
]


@dataclass(frozen=True)
class ServedModel:
    """One endpoint as checked at start."""

    endpoint: str  # base URL, without /v1
    model: str  # the name its requests carry
    server: str  # who answered: vllm, sglang, transformers, ...
    version: str
    max_model_len: int | None


def base_url(endpoint: str) -> str:
    """``http://host:8000``, ``http://host:8000/``, ``http://host:8000/v1`` -> ``http://host:8000``."""
    url = endpoint.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def fetch_json(url: str, body: dict | None = None, timeout: float = PROBE_TIMEOUT) -> dict:
    """GET (or POST `body`) and parse JSON; `urllib.error` on failure."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def same_model(served: dict, model_dir: str, served_model: str | None) -> bool:
    """Whether a ``/v1/models`` entry is `model_dir`: the name ``--served-model``
    gives, or the same path (``id`` or vLLM's ``root``), or the same checkpoint name
    (``Qwen/Qwen3.6-27B`` served, ``/models/Qwen3.6-27B`` local)."""
    names = [n for n in (served.get("id"), served.get("root")) if isinstance(n, str) and n]
    if served_model is not None:
        return served_model in names
    local = Path(model_dir).resolve()
    for name in names:
        if Path(name).expanduser().resolve() == local or name.rstrip("/").rsplit("/", 1)[-1] == local.name:
            return True
    return False


def check_endpoint(
    endpoint: str, model_dir: str, tokenizer, thinking: str, max_length: int, served_model: str | None = None
) -> ServedModel:
    url = base_url(endpoint)
    try:
        listing = fetch_json(f"{url}/v1/models")
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        raise ExtractError(
            f"endpoint {endpoint} does not answer ({reason}); start its server, or leave the --endpoint out"
        ) from None
    models = [m for m in listing.get("data", []) if isinstance(m, dict)]
    match = [m for m in models if same_model(m, model_dir, served_model)]
    if not match:
        served = ", ".join(repr(m.get("id")) for m in models) or "no model"
        wanted = repr(served_model) if served_model else f"--model {model_dir}"
        raise ExtractError(
            f"endpoint {endpoint} serves {served}, not {wanted}: the replies must come from the "
            "target the store is made with -- point --endpoint at a server of it (or name its "
            "served model with --served-model)"
        )
    entry = match[0]
    limit = entry.get("max_model_len")
    if isinstance(limit, int) and limit < max_length:
        raise ExtractError(
            f"endpoint {endpoint} serves {entry['id']!r} with max_model_len {limit} < --max-length "
            f"{max_length}: restart it with --max-model-len {max_length} or lower --max-length"
        )
    prompt_text, prompt_ids = render_prompt(tokenizer, PROBE_CONVERSATION, thinking)
    body = dict(
        model=entry["id"],
        messages=PROBE_CONVERSATION,
        add_generation_prompt=True,
        add_special_tokens=False,
        **({} if thinking == "keep" else {"chat_template_kwargs": {"enable_thinking": thinking == "on"}}),
    )
    try:
        served_ids = fetch_json(f"{url}/tokenize", body).get("tokens")
    except (urllib.error.URLError, OSError, ValueError):
        served_ids = None  # no /tokenize here: each reply's prompt_token_ids are compared instead, where returned
    if served_ids is not None and list(served_ids) != prompt_ids:
        raise ExtractError(
            f"endpoint {endpoint} renders a chat differently from --model {model_dir} "
            f"({len(served_ids)} prompt tokens, expected {len(prompt_ids)}): its tokenizer or chat "
            "template is not the target's -- serve the same checkpoint, without --chat-template"
        )
    return ServedModel(
        url,
        entry["id"],
        str(entry.get("owned_by") or "unknown"),
        _version(url),
        limit if isinstance(limit, int) else None,
    )


def _version(url: str) -> str:
    for path in ("/version", "/server_info", "/get_server_info"):  # vLLM, SGLang (new, old)
        try:
            version = fetch_json(f"{url}{path}").get("version")
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            continue
        if isinstance(version, str) and version:
            return version
    return "unknown"


def check_servers(
    endpoints, model_dir: str, tokenizer, thinking: str, max_length: int, served_model: str | None = None
) -> list[ServedModel]:
    """Every endpoint checked (`check_endpoint`), and all one server build."""
    served = [check_endpoint(e, model_dir, tokenizer, thinking, max_length, served_model) for e in endpoints]
    builds = sorted({(s.server, s.version) for s in served})
    if len(builds) > 1:
        named = "; ".join(f"{s.endpoint}: {s.server} {s.version}" for s in served)
        raise ExtractError(
            f"the endpoints run different server builds ({named}): a corpus comes from one engine "
            "-- run the same version everywhere"
        )
    return served


def server_identity(served: list[ServedModel]) -> dict:
    """What the manifest records of the servers (compared on resume: a rerun must be
    answered by the same build) and the endpoints (not compared)."""
    return dict(
        server=served[0].server, server_version=served[0].version, served_models=sorted({s.model for s in served})
    )
