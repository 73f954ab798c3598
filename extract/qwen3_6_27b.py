"""The published Qwen3.6-27B text architecture as a config-only model directory (its
config.json, no weights): what `extract plan --dry-run` and `train fit --dry-run`
read to size a job at the 27B shape on a machine that holds no checkpoint
(`python -m extract config-only-target OUT`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

QWEN3_6_VOCAB_ROWS = 248_320  # Qwen3.6's embedding rows (padded past the tokenizer's 248,070)
QWEN3_6_MASK_TOKEN_ID = 248_070  # the published drafters' mask id: the first row the tokenizer does not use

# Qwen3.5's config class with the values a released config.json carries: linear
# attention x3 then full attention, 16 times.
QWEN3_6_27B = dict(
    model_type="qwen3_5_text",
    architectures=["Qwen3_5ForCausalLM"],
    vocab_size=QWEN3_6_VOCAB_ROWS,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    eos_token_id=248046,
    pad_token_id=248044,
)


def write_config_only_target(path, tokenizer_dir=None) -> Path:
    """A Qwen3.6-27B directory with only its config.json (+ the files of
    `tokenizer_dir`, which the dry-runs tokenize the corpus with). No weights."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN3_6_27B, indent=2))
    if tokenizer_dir is not None:
        for file in Path(tokenizer_dir).iterdir():
            if file.is_file():
                shutil.copy(file, path / file.name)
    return path
