"""The CUDA paths: SDPA over gathered blocks, the step's copies to and from the device, the
sampler, LoRA slots, the int8 cache, compile and the server, each against transformers (or PEFT)
on the same GPU. Runs only where a GPU is present (marker `gpu`; `benchmarks/gpu.sh run`).

float32 comparisons are token-exact, as on the CPU: TF32 is off in PyTorch by default, and the
test models' logit gaps stay far above float32 noise (tests/serve/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from compress.load_spec import NO_HUB_KERNELS
from serve import LLMEngine, SamplingParams
from serve.core.config import (
    AttentionBackend,
    CacheConfig,
    KVCacheDtype,
    ModelConfig,
    SchedulerConfig,
)
from serve.lora.registry import LoraConfig
from serve.model.kv_cache import Int8KV
from tests.serve.conftest import Case, generate_each, make_cases
from tests.serve.server_util import start_thread_server
from tests.serve.test_engine_exact import assert_equal, run
from tests.serve.test_lora_engine import ADAPTERS, make_adapter, run_all, with_and_without

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]


def cuda_engine(
    model_dir: Path,
    dtype: str = "float32",
    num_blocks: int = 512,
    budget: int = 2048,
    kv_cache_dtype: KVCacheDtype = "auto",
    lora: LoraConfig | None = None,
    compile_model: bool = False,
    backend: AttentionBackend = "auto",
) -> LLMEngine:
    model = ModelConfig(
        str(model_dir),
        dtype=dtype,  # type: ignore[arg-type]
        device="cuda",
        compile=compile_model,
        attention_backend=backend,
    )
    return LLMEngine(
        model,
        CacheConfig(block_size=16, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
        SchedulerConfig(max_num_batched_tokens=budget),
        lora=lora,
    )


def cuda_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **NO_HUB_KERNELS).cuda().eval()
    )


def log_likelihoods(model: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    """log p(token t | tokens < t) for t = 1 .. len - 1, in float32."""
    with torch.inference_mode():
        ids = torch.tensor([sequence], device="cuda")
        logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
        return logprobs.gather(-1, ids[0, 1:, None])[:, 0].cpu()


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_bf16_engine_is_as_close_to_float32_as_transformers_bf16_on_cuda(
    model_dirs: dict[str, Path], cases: list[Case], compile_model: bool
) -> None:
    """bf16 rounds differently in every kernel (inductor's fused graphs keep float32 between ops
    where eager rounds to bf16), so greedy paths may fork after near-ties: token equality with
    `generate` is no contract here. The contract is accuracy: over the prompt and 8 generated
    tokens (prefill and decode steps, compiled graphs included) the log-probability the engine
    reports for each token is as close to the float32 model's as transformers' own bf16 is."""
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
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    prompts = [c.prompt for c in cases if len(c.prompt) > 1][:16]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({int(o.request_id): o for o in engine.step() if o.finished})
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks
    reference, peer = (
        cuda_model(model_dirs["llama"]),
        cuda_model(model_dirs["llama"], torch.bfloat16),
    )
    engine_error, peer_error = [], []
    for i, p in enumerate(prompts):
        out = outputs[i]
        sequence = p + out.token_ids
        reported = [lp[t] for t, lp in zip(p[1:], out.prompt_logprobs[1:], strict=True)]
        reported += [lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
        truth = log_likelihoods(reference, sequence)
        engine_error.append((torch.tensor(reported) - truth).abs())
        peer_error.append((log_likelihoods(peer, sequence) - truth).abs())
    ours, theirs = torch.cat(engine_error).mean().item(), torch.cat(peer_error).mean().item()
    print(f"bf16 mean |logprob - float32's|: engine {ours:.5f}, transformers {theirs:.5f}")
    assert 0 < ours <= 1.5 * theirs, (ours, theirs)


ONE_CALL: list[AttentionBackend] = ["flex", "padded-sdpa"]
"""The CUDA backends attending every decode in one call a layer, every prefill chunk in another
(auto picks flex where it runs): each token-exact in float32 like the CPU's."""


@pytest.mark.parametrize("backend", ONE_CALL)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "mistral"])
def test_float32_engine_equals_generate_on_cuda(
    arch: str, backend: AttentionBackend, model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    engine = cuda_engine(model_dirs[arch], backend=backend)
    assert engine.runner.device.type == "cuda"
    expected = generate_each(cuda_model(model_dirs[arch]), cases)
    assert_equal(run(engine, cases), expected, list(range(len(cases))))


@pytest.mark.parametrize("backend", ONE_CALL)
def test_float32_engine_on_cuda_keeps_its_tokens_through_preemption_chunks_and_prefix_hits(
    backend: AttentionBackend, model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """A 40-block pool preempts, a 128-token budget chunks prompts, the second pass hits the
    prefix cache: the same tokens as with ample KV, and every block free after each run (`run`)."""
    ample = run(cuda_engine(model_dirs["llama"], backend=backend), cases)
    tight = cuda_engine(model_dirs["llama"], num_blocks=40, budget=128, backend=backend)
    ids = list(range(len(cases)))
    assert_equal(run(tight, cases), [ample[i] for i in ids], ids)
    assert_equal(run(tight, cases[:8]), [ample[i] for i in range(8)], list(range(8)))
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_lora_mixed_batch_equals_peft_on_cuda(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Four adapters and the base in one batch, device slots on the GPU: each request's greedy
    tokens equal PEFT's on the GPU with only its adapter active."""
    from peft import PeftModel

    model_dir = model_dirs["llama"]
    adapters = {
        name: make_adapter(model_dir, tmp_path / name, i, **cfg)
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    prompts = make_cases(6, seed=11, vocab=500, max_prompt=40)
    cases = [Case(c.prompt, 12) for c in prompts]
    engine = cuda_engine(
        model_dir, num_blocks=256, budget=256, lora=LoraConfig(max_loras=4, max_lora_rank=16)
    )
    versions = {name: engine.load_lora(name, str(path)) for name, path in adapters.items()}
    requests, expected = [], {}
    for name in [None, *adapters]:
        model = cuda_model(model_dir)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        reference = generate_each(model, cases)
        for i, c in enumerate(cases):
            requests.append((f"{name}-{i}", c.prompt, versions[name] if name else None))
            expected[f"{name}-{i}"] = reference[i]
    interleaved = sorted(requests, key=lambda r: int(r[0].rsplit("-", 1)[1]))
    outputs = run_all(engine, interleaved, 12)
    assert {rid: outputs[rid] for rid in expected} == expected
    assert any(expected[f"qv4-{i}"] != expected[f"None-{i}"] for i in range(len(cases)))
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize("backend", ONE_CALL)
def test_int8_kv_on_cuda_equals_generate_over_keys_and_values_rounded_as_stored(
    backend: AttentionBackend, model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    from evals.int8_kv import with_kv_cache_dtype

    engine = cuda_engine(model_dirs["llama"], kv_cache_dtype="int8", backend=backend)
    keys = engine.runner.kv_caches[0][0]
    assert isinstance(keys, Int8KV) and keys.data.is_cuda and keys.data.dtype == torch.int8
    model = with_kv_cache_dtype(cuda_model(model_dirs["llama"]), "int8")
    expected = generate_each(model, cases[:12])
    assert_equal(run(engine, cases[:12]), expected, list(range(12)))


@pytest.mark.parametrize("backend", ONE_CALL)
def test_one_call_backends_replay_decode_graphs_on_cuda(
    backend: AttentionBackend, model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """Gemma 3 (sliding-window layers) on CUDA graphs: decode steps replay captured graphs
    through the backend, token-equal to the same backend run eagerly and to `generate`."""
    model_dir = model_dirs["gemma3"]
    engine = cuda_engine(model_dir, backend=backend)
    kind = {"flex": "FlexAttentionBackend", "padded-sdpa": "PaddedSDPABackend"}[backend]
    assert type(engine.runner.backend).__name__ == kind
    graphed = run(engine, cases[:16])
    assert dict(engine.stats().decode_paths)["graph"] > 0
    eager = LLMEngine(
        ModelConfig(
            str(model_dir),
            dtype="float32",
            device="cuda",
            attention_backend=backend,
            enforce_eager=True,
        ),
        CacheConfig(block_size=16, num_blocks=512),
        SchedulerConfig(max_num_batched_tokens=2048),
    )
    ids = list(range(16))
    assert_equal(run(eager, cases[:16]), [graphed[i] for i in ids], ids)
    assert_equal(graphed, generate_each(cuda_model(model_dir), cases[:16]), ids)


def test_auto_attention_on_cuda_is_flex(model_dirs: dict[str, Path]) -> None:
    engine = cuda_engine(model_dirs["llama"], num_blocks=16)
    assert type(engine.runner.backend).__name__ == "FlexAttentionBackend"


def test_seeded_samples_on_cuda_do_not_depend_on_the_batch(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    def sample(prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        engine = cuda_engine(model_dirs["llama"])
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [out[str(i)] for i in range(len(prompts))]

    params = SamplingParams(max_tokens=24, temperature=1.0, seed=42)
    alone = sample([cases[5].prompt], [params])[0]
    others = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i) for i in range(6)]
    crowd = sample([c.prompt for c in cases[:6]] + [cases[5].prompt], [*others, params])
    assert crowd[-1] == alone
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, seed=43)
    assert sample([cases[5].prompt], [other_seed])[0] != alone


def test_prompt_logprobs_on_cuda_equal_transformers(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """What the engine-backed evaluation reads: every prompt token's log-probability, within
    1e-4 nats of transformers' log-softmax on the same GPU."""
    prompts = [c.prompt for c in cases if len(c.prompt) > 8][:8]
    engine = cuda_engine(model_dirs["llama"], budget=256)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=1, prompt_logprobs=0))
    got: dict[int, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ids = prompts[int(out.request_id)]
                got[int(out.request_id)] = [
                    lp[t] for t, lp in zip(ids[1:], out.prompt_logprobs[1:], strict=True)
                ]
    model = cuda_model(model_dirs["llama"])
    for i, p in enumerate(prompts):
        want = log_likelihoods(model, p)
        torch.testing.assert_close(torch.tensor(got[i]), want, rtol=0, atol=1e-4)


def test_server_on_cuda_streams_what_it_returns_whole(model_dirs: dict[str, Path]) -> None:
    server = start_thread_server(model_dirs["llama"], device="cuda")
    try:
        assert server.engine.engine.runner.device.type == "cuda"
        body = {"model": "test-model", "prompt": "hello there", "max_tokens": 16, "temperature": 0}
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            assert response.status_code == 200
            lines = [x for x in response.iter_lines() if x.startswith("data: {")]
        streamed = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines)
        assert whole["usage"]["completion_tokens"] == 16
        assert streamed == whole["choices"][0]["text"]
    finally:
        server.stop()


def test_kv_cache_sized_from_free_gpu_memory(model_dirs: dict[str, Path]) -> None:
    """The fraction is of the memory free once the weights are loaded (a tiny model here: under
    1% of the free memory before the engine starts)."""
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    engine = LLMEngine(
        ModelConfig(str(model_dirs["llama"]), dtype="bfloat16", device="cuda"),
        CacheConfig(block_size=16, kv_cache_memory_fraction=0.01),
    )
    block = engine.runner.layout.bytes_per_token() * 16
    assert 0.0099 * free_before < engine.runner.kv_bytes <= 0.01 * free_before + block
    assert torch.cuda.memory_allocated() >= engine.runner.kv_bytes


@pytest.fixture(scope="module")
def bnb_variants(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """The tiny demo model quantized by transformers' bitsandbytes integration on the GPU (int8,
    nf4), as a user's bitsandbytes checkpoint, and a LoRA adapter for it (PEFT, random B)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    root = tmp_path_factory.mktemp("bnb")
    configs = {
        "int8": BitsAndBytesConfig(load_in_8bit=True),
        "nf4": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        ),
    }
    out = {}
    for name, config in configs.items():
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, quantization_config=config, device_map="cuda", **NO_HUB_KERNELS
        )
        model.save_pretrained(root / name)
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(root / name)
        out[name] = root / name
    out["adapter"] = make_adapter(tiny_model_dir, root / "adapter", 3, **ADAPTERS["all8-rs"])
    return out


@pytest.mark.parametrize("variant", ["int8", "nf4"])
def test_bitsandbytes_variant_on_cuda_equals_generate(
    bnb_variants: dict[str, Path], variant: str
) -> None:
    """bitsandbytes' own CUDA kernels on both sides (the engine replaces layers only on the CPU)."""
    from transformers import AutoModelForCausalLM

    cases = make_cases(8, seed=5, vocab=500, max_prompt=60, max_out=16)
    model = AutoModelForCausalLM.from_pretrained(
        bnb_variants[variant], device_map="cuda", **NO_HUB_KERNELS
    ).eval()
    expected = generate_each(model, cases)
    engine = cuda_engine(bnb_variants[variant], num_blocks=64, budget=64)
    kinds = {type(m).__name__ for m in engine.runner.model.modules()}
    assert kinds & {"Linear8bitLt", "Linear4bit"} and not kinds & {"Int8Linear", "FourBitLinear"}
    assert_equal(run(engine, cases), expected, list(range(len(cases))))


def test_lora_adapter_on_cuda_equals_peft_on_the_nf4_base(bnb_variants: dict[str, Path]) -> None:
    """QLoRA's serving side: an adapter over bitsandbytes' 4-bit layers on the GPU, mixed with
    plain requests in one batch, against PEFT on the same nf4 model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = bnb_variants["nf4"], bnb_variants["adapter"]
    cases = [Case(c.prompt, 12) for c in make_cases(6, seed=9, vocab=500, max_prompt=40)]
    engine = cuda_engine(
        base, num_blocks=128, budget=128, lora=LoraConfig(max_loras=2, max_lora_rank=8)
    )
    version = engine.load_lora("shop", str(adapter))
    outputs = run_all(engine, with_and_without(cases, version), 12)
    plain = AutoModelForCausalLM.from_pretrained(base, device_map="cuda", **NO_HUB_KERNELS).eval()
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, device_map="cuda", **NO_HUB_KERNELS), adapter
    ).eval()
    for name, model in (("lora", with_adapter), ("base", plain)):
        expected = generate_each(model, cases)
        assert [outputs[f"{i}-{name}"] for i in range(len(cases))] == expected, name
    assert any(outputs[f"{i}-lora"] != outputs[f"{i}-base"] for i in range(len(cases)))
