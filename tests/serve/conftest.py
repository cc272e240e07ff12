"""Small random-weight models of three architectures, and their transformers reference outputs.

Weights are drawn with a large init range so that greedy outputs vary and the top-2 logit gap
stays well above float32 noise: token-exact comparison against `generate` is then meaningful.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from compress.load_model import load_model
from serve.model import cpu_attention
from tests.serve.server_util import ThreadServer, start_thread_server

if TYPE_CHECKING:  # imported by the fixture: the GPU check runs without the openai client
    import openai

needs_c_compiler = pytest.mark.skipif(
    cpu_attention.load_kernel() is None,
    reason="no C compiler (cc or $CC) to build the paged-cpu kernel: the engine uses SDPA here",
)
PAGED_CPU = pytest.param("paged-cpu", marks=needs_c_compiler)
"""The paged-cpu backend as a parameter: skipped, saying why, where its kernel cannot be built."""

ARCHITECTURES = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma3": Gemma3TextConfig,
    "mistral": MistralConfig,
}
ARCH_EXTRA = {
    "mistral": {"sliding_window": 16},
    "gemma3": {
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 16,
    },
}
"""Gemma 3 as the real one interleaves them (local layers of 512 then a global one), and
Mistral's window covers every layer; 16-token windows, so that most test prompts outrun them."""


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    max_tokens: int


def make_model(arch: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = ARCHITECTURES[arch](
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **ARCH_EXTRA.get(arch, {}),
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_cases(
    n: int, seed: int, vocab: int, max_prompt: int = 300, max_out: int = 64
) -> list[Case]:
    rng = random.Random(seed)
    lengths = [1, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 2)]
    return [
        Case([rng.randrange(6, vocab) for _ in range(length)], rng.randint(1, max_out))
        for length in lengths
    ]


def reference_outputs(model_dir: Path, cases: list[Case]) -> list[list[int]]:
    return generate_each(load_model(model_dir), cases)


def generate_each(model: torch.nn.Module, cases: list[Case]) -> list[list[int]]:
    """`generate`, greedy, one request at a time (no padding), stopping at eos like the engine,
    on the model's device."""
    outs = []
    with torch.inference_mode():
        for case in cases:
            ids = torch.tensor([case.prompt], device=model.device)
            gen = model.generate(  # type: ignore[operator]
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=case.max_tokens,
                do_sample=False,
            )
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


@pytest.fixture(scope="session")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {a: make_model(a, tiny_model_dir, root / a) for a in ARCHITECTURES}


@pytest.fixture(scope="session")
def cases(model_dirs: dict[str, Path]) -> list[Case]:
    vocab = AutoTokenizer.from_pretrained(model_dirs["llama"]).__len__()
    return make_cases(32, seed=1234, vocab=vocab)


@pytest.fixture(scope="session")
def references(model_dirs: dict[str, Path], cases: list[Case]) -> dict[str, list[list[int]]]:
    return {a: reference_outputs(d, cases) for a, d in model_dirs.items()}


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[ThreadServer]:
    """A real server (uvicorn, a free port) on the tiny Llama, one per test module."""
    s = start_thread_server(model_dirs["llama"], max_waiting=1000)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ThreadServer) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
