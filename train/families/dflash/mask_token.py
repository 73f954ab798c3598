"""The mask token of a run: which id fills slots 1..B-1 of every block.

Resolved as SpecForge resolves it, first rule that gives an id wins:

1. "configured": `model.mask_token_id`;
2. "init_from": the `dflash_config.mask_token_id` of the drafter a fine-tuning
   run starts from (`fit --init-from DIR`), so its embedding row means the same;
3. "tokenizer": the target tokenizer's mask token, or a token spelled `<|MASK|>`
   or `<mask>` (any case) in its vocabulary;
4. "first_unused_row": `len(tokenizer)`, the first embedding row no token uses,
   when it is below the target's vocabulary size (Qwen3.6: 248070 of 248320,
   the id z-lab's published drafter uses);
5. else the run is refused, saying how to set it.

The id must have a row in the target's embedding table. The trainer logs which
rule chose it, saves the id in the run's config and the rule in its
checkpoints; an export records both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from train.config_error import ConfigError

MASK_SPELLINGS = ("<|mask|>", "<mask>")  # matched case-insensitively
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True)
class MaskToken:
    id: int
    rule: str  # "configured", "init_from", "tokenizer" or "first_unused_row"

    def describe(self) -> str:
        return f"mask token id {self.id} (rule: {self.rule})"


def resolve_mask_token(
    configured: int | None, target_dir: str | Path, vocab_size: int, init_from_id: int | None = None
) -> MaskToken:
    """The run's mask token by the module's rules; ConfigError (naming
    model.mask_token_id) when no rule gives one or the id has no embedding row."""
    if configured is not None:
        return _inside(MaskToken(configured, "configured"), vocab_size)
    if init_from_id is not None:
        return _inside(MaskToken(init_from_id, "init_from"), vocab_size)
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise ConfigError(
            f"config model.mask_token_id: not set, and {target_dir} has no tokenizer to find a mask "
            "token in; set model.mask_token_id to an id inside the target's embedding table"
        )
    found = tokenizer_mask_id(tokenizer)
    if found is not None:
        return _inside(MaskToken(found, "tokenizer"), vocab_size)
    if len(tokenizer) < vocab_size:
        return MaskToken(len(tokenizer), "first_unused_row")
    raise ConfigError(
        f"config model.mask_token_id: not set; the tokenizer in {target_dir} has no mask token (<|MASK|> / <mask>) "
        f"and no unused embedding row (len(tokenizer) {len(tokenizer)} >= vocabulary {vocab_size}); set "
        "model.mask_token_id to an id inside the target's embedding table"
    )


def load_tokenizer(target_dir: str | Path):
    """The target's tokenizer (transformers, local files only, no remote code), or
    None when the directory holds none."""
    target_dir = Path(target_dir)
    if not any((target_dir / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False, local_files_only=True)


def tokenizer_mask_id(tokenizer) -> int | None:
    """The tokenizer's declared mask token, else the lowest id spelled like one."""
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    matches = [i for token, i in tokenizer.get_vocab().items() if token.lower() in MASK_SPELLINGS]
    return min(matches) if matches else None


def _inside(mask: MaskToken, vocab_size: int) -> MaskToken:
    if not 0 <= mask.id < vocab_size:
        raise ConfigError(
            f"config model.mask_token_id: {mask.id} (rule: {mask.rule}) is outside the target "
            f"vocabulary [0, {vocab_size})"
        )
    return mask
