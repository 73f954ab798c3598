"""The one exit-code and error rule of every command (`python -m extract`,
`python -m store_schema`, `python -m train`):

    0  success
    1  refused, or a problem found: input that exists but is wrong (a store from
       another target, a corrupt shard, a bad config value, verify problems,
       diagnose findings)
    2  usage: bad arguments, or a path that does not exist
    3  incomplete: `verify` on an intact store whose planned shards are not all
       extracted yet (rerun `extract run` to finish)
  130  interrupted (Ctrl-C, or SIGTERM: Slurm preemption, Kubernetes eviction, `timeout`)

An error is one line on stderr, `error: <what, naming the file/field>`, never a
traceback. Ctrl-C prints one line, `interrupted: <what was kept>; <how to resume>`
(`interrupted`), and no traceback; SIGTERM is handled as Ctrl-C (`terminate_as_interrupt`)."""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import threading
from collections.abc import Callable

from .units import parse_bytes

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_INTERRUPTED = 130
SKIP_SPACE_CHECK_FLAG = "--skip-space-check"  # every command that checks free space before it writes


class UsageError(Exception):
    """The command was called wrongly; exits 2."""


def fail(message: str, code: int = EXIT_PROBLEM) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def interrupted(kept: str = "", resume: str = "") -> int:
    """The one Ctrl-C line: what the command kept and how to go on."""
    detail = "; ".join(part for part in (kept, resume) if part)
    print(f"interrupted: {detail}" if detail else "interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def terminate_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so a preempted or evicted job keeps
    what Ctrl-C keeps (a checkpoint, committed shards) and says how to resume. Called again
    after a library that installs its own SIGTERM handler (Ray's prints a stack dump). Not
    in a torchrun rank (LOCAL_RANK set): there SIGTERM is the launcher tearing the group
    down, and the rank ends as it always has; a process forked from this one (a planning
    pool's worker) is terminated by it as by default."""
    global _MAIN_PID
    if threading.current_thread() is threading.main_thread() and "LOCAL_RANK" not in os.environ:
        _MAIN_PID = os.getpid()
        signal.signal(signal.SIGTERM, _interrupt)


_MAIN_PID: int | None = None


def _interrupt(signum, frame):
    if os.getpid() != _MAIN_PID:  # a forked child inherited the handler: die as SIGTERM means
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise KeyboardInterrupt


def run_command(handler: Callable[[object], int], args, refusals: tuple[type[BaseException], ...] = ()) -> int:
    """Run a subcommand's handler under the rule above. `refusals` are the
    package's own error types meant for the user (exit 1), besides ValueError,
    KeyError and OSError."""
    problems: tuple[type[BaseException], ...] = (*refusals, ValueError, KeyError, OSError)
    terminate_as_interrupt()
    try:
        return handler(args)
    except KeyboardInterrupt:
        return interrupted()
    except (UsageError, FileNotFoundError, NotADirectoryError) as error:
        return fail(_message(error), EXIT_USAGE)
    except problems as error:
        return fail(_message(error), EXIT_PROBLEM)


def size_argument(text: str) -> int:
    """An argparse `type` for a size flag (`units.parse_bytes`: 20GB, 2TiB); argparse
    names the flag in the usage error (exit 2)."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def shown_default(action) -> bool:
    """Does this option's default say something (not None, off, or an empty list)?"""
    quiet = action.default is None or action.default is False or action.default == argparse.SUPPRESS
    return not quiet and action.default != [] and bool(action.option_strings)


class CommandParser(argparse.ArgumentParser):
    """A command's parser (its subcommands' parsers are made of the same class): no
    option abbreviations (`--stor` is not `--store`), and an unknown option is refused
    by the subcommand that was called, with its usage and the nearest option it has,
    not by the top-level parser with the top-level usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:  # a leaf: no parser above it knows its options
            options = [option for action in self._actions for option in action.option_strings]
            hints = [
                f"{extra} (did you mean {near[0]}?)"
                if (near := difflib.get_close_matches(extra.split("=", 1)[0], options, n=1))
                else extra
                for extra in extras
            ]
            self.error(f"unrecognized arguments: {' '.join(hints)}")
        return parsed, extras


def parsers_of(parser) -> list:
    """`parser` and every subcommand's parser under it."""
    found = [parser]
    for action in parser._actions:  # argparse keeps no public list of them
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += parsers_of(sub)
    return found


def show_defaults(parser) -> None:
    """Every option of `parser` and its subcommands with a default says it in `--help`
    (appended where the help text does not already show it: `%(default)s` or its own
    "(default ...)" wording)."""
    for each in parsers_of(parser):
        for action in each._actions:
            said = "%(default)" in (action.help or "") or "(default" in (action.help or "")
            if shown_default(action) and action.help != argparse.SUPPRESS and not said:
                action.help = f"{action.help} (default %(default)s)" if action.help else "default %(default)s"


def _message(error: BaseException) -> str:
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(str(text).split()) or type(error).__name__
