"""Progress of a long pass (planning, extraction, training), wherever its output goes.

On a terminal: a live tqdm bar. Without one (``ray job logs --follow``, a batch
system's log file): one line every ``interval`` seconds and one at the end, e.g.

    extract: 1,234/5,000 samples (24.7%), 12/40 shards, 3,210 tokens/s, ETA 0:12:34
    fit: 120/600 steps (20.0%), 960 samples, 3,210 tokens/s, loss 2.31, ETA 0:12:34

so a job that runs for hours says how far it is. ``mode="off"`` prints nothing.
One owner for every command's progress: `extract` and `train fit` both use it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta


def default_mode(enabled: bool = True) -> str:
    """ "bar" on a terminal, "lines" otherwise, "off" when not `enabled`."""
    if not enabled:
        return "off"
    return "bar" if sys.stderr.isatty() else "lines"


class Progress:
    def __init__(
        self,
        desc: str,
        total: int,
        unit: str,
        *,
        mode: str = "off",
        interval: float = 30.0,
        initial: int = 0,
        log: Callable[[str], None] | None = None,
        clock=time.monotonic,
    ):
        self.desc, self.total, self.unit, self.mode, self.interval = desc, int(total), unit, mode, float(interval)
        self.done = int(initial)
        self._start_done = self._line_done = self.done
        self._clock = clock
        self._started = self._last_line = clock()
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._extra: dict[str, str] = {}
        self._shown: dict[str, str] = {}
        self._tokens = 0
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm  # tqdm only for a terminal's bar

            self._bar = tqdm(
                total=self.total,
                initial=self.done,
                unit=unit,
                desc=desc,
                mininterval=1.0,
                smoothing=0.1,
                file=sys.stderr,
            )

    def update(self, count: int, tokens: int = 0, **extra) -> None:
        """`count` more units done (and `tokens` more tokens, for a tokens/s figure);
        `extra` fields (e.g. ``shards="3/40"``) are shown beside."""
        self.done += int(count)
        self._tokens += int(tokens)
        self._extra.update({k: str(v) for k, v in extra.items()})
        if self._bar is not None:
            self._bar.update(int(count))
            self._bar.set_postfix(self._postfix(), refresh=False)
        else:
            self.tick()

    def show(self, **fields) -> None:
        """Latest values shown as ``key value`` (e.g. ``loss="2.31"``), after the rate;
        they do not print a line by themselves."""
        self._shown.update({k: str(v) for k, v in fields.items()})
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(), refresh=False)

    def _postfix(self) -> dict[str, str]:
        rate = {"tok_s": f"{self._rate(self._tokens):.0f}"} if self._tokens else {}
        return dict(self._extra, **rate, **self._shown)

    def tick(self) -> None:
        """Print a line if one is due (called between updates too, so a slow start
        still says where it is)."""
        if self.mode == "lines" and self._clock() - self._last_line >= self.interval:
            self._line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines" and self.done > self._start_done and self.done != self._line_done:
            self._line()  # the last count, unless the last line already said it

    def _rate(self, amount: float) -> float:
        return amount / max(self._clock() - self._started, 1e-9)

    def _line(self) -> None:
        self._last_line, self._line_done = self._clock(), self.done
        parts = [f"{self.done:,}/{self.total:,} {self.unit}s ({100 * self.done / max(self.total, 1):.1f}%)"]
        parts += [f"{value} {key}" for key, value in self._extra.items()]
        if self._tokens:
            parts.append(f"{self._rate(self._tokens):,.0f} tokens/s")
        else:
            parts.append(f"{self._rate(self.done - self._start_done):,.1f} {self.unit}s/s")
        parts += [f"{key} {value}" for key, value in self._shown.items()]
        parts.append(f"ETA {self.eta()}")
        self._log(f"{self.desc}: " + ", ".join(parts))

    def eta(self) -> str:
        rate = self._rate(self.done - self._start_done)
        if rate <= 0:
            return "unknown"
        return str(timedelta(seconds=round((self.total - self.done) / rate)))
