"""Mask-token resolution, each rule in order (SpecForge's order), on real
tokenizers trained here with and without a mask token."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from train.config_error import ConfigError
from train.families.dflash.mask_token import MaskToken, resolve_mask_token

TEXT = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20


def make_tokenizer(path, specials=(), mask_token=None, vocab_size=300) -> int:
    """A byte-level BPE tokenizer with `specials` added, optionally declaring
    `mask_token`, saved to `path`; returns len(tokenizer)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXT, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", mask_token=mask_token)
    fast.save_pretrained(str(path))
    return len(fast)


def token_id(path, token: str) -> int:
    return PreTrainedTokenizerFast.from_pretrained(str(path)).convert_tokens_to_ids(token)


def test_each_rule_in_order(tmp_path):
    declared = tmp_path / "declared"  # declares [MASK] as its mask token, and also spells <|mask|>
    make_tokenizer(declared, specials=["[MASK]", "<|mask|>"], mask_token="[MASK]")
    # 1. the configured id wins over everything
    assert resolve_mask_token(7, declared, 512, init_from_id=9) == MaskToken(7, "configured")
    # 2. then the drafter a fine-tuning run starts from
    assert resolve_mask_token(None, declared, 512, init_from_id=9) == MaskToken(9, "init_from")
    # 3. then the tokenizer's declared mask token ...
    assert resolve_mask_token(None, declared, 512) == MaskToken(token_id(declared, "[MASK]"), "tokenizer")
    # ... or a token spelled like one, in any case
    for spelling in ("<|MASK|>", "<mask>", "<Mask>"):
        path = tmp_path / f"spelled-{len(spelling)}-{spelling.strip('<|>')}"
        make_tokenizer(path, specials=["<|im_start|>", spelling])
        assert resolve_mask_token(None, path, 512) == MaskToken(token_id(path, spelling), "tokenizer"), spelling
    # 4. then the first embedding row no token uses
    plain = tmp_path / "plain"
    size = make_tokenizer(plain, specials=["<|im_start|>"])
    assert size < 512
    assert resolve_mask_token(None, plain, 512) == MaskToken(size, "first_unused_row")
    # 5. else refused, naming the key
    with pytest.raises(ConfigError, match=rf"model.mask_token_id: .*no unused embedding row \(len\(tokenizer\) {size}"):
        resolve_mask_token(None, plain, size)


def test_ids_without_an_embedding_row_and_a_missing_tokenizer_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.mask_token_id: 512 \(rule: configured\) is outside"):
        resolve_mask_token(512, tmp_path, 512)
    with pytest.raises(ConfigError, match=r"model.mask_token_id: 600 \(rule: init_from\) is outside"):
        resolve_mask_token(None, tmp_path, 512, init_from_id=600)
    with pytest.raises(ConfigError, match="model.mask_token_id: not set, and .* has no tokenizer"):
        resolve_mask_token(None, tmp_path, 512)
