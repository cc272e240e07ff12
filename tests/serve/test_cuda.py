"""The CUDA path (bf16, SDPA over gathered blocks): runs only where a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from tests.serve.conftest import Case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_bf16_engine_agrees_with_generate_on_cuda(
    model_dirs: dict[str, Path], cases: list[Case], compile_model: bool
) -> None:
    """bf16 rounding differs between kernels, so greedy paths may fork after a near-tie: compare
    the first 8 tokens, and require agreement on at least 90% of the requests."""
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(
        ModelConfig(
            str(model_dirs["llama"]), dtype="bfloat16", device="cuda", compile=compile_model
        ),
        CacheConfig(block_size=16, kv_cache_bytes=256 << 20),
        SchedulerConfig(max_num_batched_tokens=256),
    )
    assert (
        engine.runner.kv_caches[0][0].is_cuda
        and engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    )
    for i, c in enumerate(cases):
        engine.add_request(
            str(i), c.prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        )
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    model = (
        AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.bfloat16)
        .cuda()
        .eval()
    )
    agree = 0
    for i, c in enumerate(cases):
        ids = torch.tensor([c.prompt], device="cuda")
        ref = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[
            0, len(c.prompt) :
        ]
        agree += ref.tolist() == outputs[str(i)]
    assert agree >= 0.9 * len(cases)
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


def test_kv_cache_sized_from_free_gpu_memory(model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine(
        ModelConfig(str(model_dirs["llama"]), dtype="bfloat16", device="cuda"),
        CacheConfig(block_size=16, kv_cache_memory_fraction=0.01),
    )
    free, _ = torch.cuda.mem_get_info()
    assert (
        0.005 * free
        < engine.runner.kv_bytes
        <= 0.0101 * free + engine.runner.layout.bytes_per_token() * 16
    )
