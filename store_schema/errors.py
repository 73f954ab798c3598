"""Every refusal of the store package, under one base: a command catches `StoreError`
and prints its one line (exit 1), whatever part of the store refused. Each class
also keeps the builtin base it always had, so older `except ValueError` and
`except RuntimeError` clauses still catch it."""

from __future__ import annotations


class StoreError(Exception):
    """Something about a store that the user must act on, said in one line."""


class RecordError(StoreError, ValueError):
    """A commit record is missing, unparsable, or does not match its own hash."""


class CorruptShardError(StoreError, RuntimeError):
    """A committed shard's file is missing, differs from its commit record, or
    cannot be decoded; names the shard and the file."""

    def __init__(self, shard: str, file: str, what: str):
        self.shard, self.file, self.what = shard, file, what
        super().__init__(f"shard {shard}: {file}: {what}")


class StoreLockedError(StoreError, RuntimeError):
    """Another live job holds the store (or this one lost its hold)."""


class ShardFenced(StoreError, RuntimeError):
    """This writer's attempt was revoked by the driver (or its run is over): it must not commit."""


class StoreExistsError(StoreError, FileExistsError):
    """The destination holds another store; never overwritten in place."""


class NonFiniteStatesError(StoreError, ValueError):
    """Hidden states with NaN or Inf offered to a store (bf16 or fp8): a drafter trained on
    them learns nothing, and nothing downstream could tell."""

    @classmethod
    def at_tokens(cls, bad_tokens, what: str, limit: str = "") -> "NonFiniteStatesError":
        """The one message: `what`, how many tokens held NaN/Inf and the first of them."""
        return cls(
            f"{what}: NaN/Inf in the hidden states of {len(bad_tokens)} token(s), first at token "
            f"{int(bad_tokens[0])}; a store refuses non-finite states{limit}"
        )


class EmptyCaptureError(StoreError, ValueError):
    """A shard's captured layer carries no signal (all zeros, or constant across tokens)."""


class LocalCopyError(StoreError, ValueError):
    """The directory holds something other than a copy of this store."""
