"""Fixtures more than one train test module uses: decoding on one thread, the mask
token, and the vLLM environment with the tiny target it serves."""

from __future__ import annotations

import shutil

import builders
import pytest
import torch
from transformers import Qwen3ForCausalLM

from train.serving import serve_check


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core
    machine two threads contending made decoding ~10x slower (modules that decode
    use it: `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def mask_id(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|mask|>")


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM environment's python; a failure naming why when there is none."""
    try:
        python = serve_check.find_vllm_python()
        serve_check.probe(python)
    except (serve_check.ServeRefused, FileNotFoundError) as error:
        pytest.fail(f"serve-check needs vLLM: {error}")
    return python


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizer_dir):
    """A tiny dense Qwen3 (hidden 64, 2 heads x 32, 1 KV head: vLLM's CPU attention
    needs head_dim >= 32) with the tokenizer. Weights at 2.5x the default init, seed 2:
    its greedy replies to the coding prompts fall into short loops, text a drafter
    learns in a few CPU steps."""
    path = tmp_path_factory.mktemp("qwen3_h32")
    config = builders.qwen3_config(512)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    config.initializer_range = 0.05
    torch.manual_seed(2)
    Qwen3ForCausalLM(config).save_pretrained(str(path))
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return path
