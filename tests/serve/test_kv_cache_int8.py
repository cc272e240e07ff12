"""The int8 KV cache: codes and a scale per (token, KV head), read in place by the paged CPU
kernel and dequantized by SDPA and the reference; the engine on it fits 4 x head_dim /
(head_dim + 4) times the float32 tokens in the same budget, agrees with itself whatever it does (preemption, chunking, prefix hits), and
stays within a tolerance of the float cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.model import cpu_attention
from serve.model.attention import AttentionMetadata, SequenceSlice
from serve.model.kv_cache import Int8KV, quantize_int8, write_slots
from serve.model.sdpa_attention import ReferenceBackend, SDPABackend
from serve.model.step_inputs import decode_groups
from tests.serve.conftest import PAGED_CPU, Case, needs_c_compiler
from tests.serve.test_cpu_attention import DECOMPOSITIONS, scattered_decode
from tests.serve.test_engine_exact import assert_equal, run


def as_int8(cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> Int8KV:
    codes, scales = quantize_int8(cache)
    return Int8KV(codes, scales, dtype)


def test_quantize_int8_rounds_each_vector_to_its_own_scale() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.tensor([1e-3, 1.0, 50.0])[None, :, None]
    x[2, 1] = 0.0
    codes, scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.shape == (5, 3)
    assert codes.abs().amax(-1)[x.abs().amax(-1) > 0].eq(127).all()  # each vector spans its range
    assert codes[2, 1].eq(0).all() and 0 < scales[2, 1] < 1e-30
    error = (codes.float() * scales[..., None] - x).abs()
    assert (error <= scales[..., None] / 2 * (1 + 1e-6)).all()


def test_int8_cache_writes_slots_and_reads_whole_blocks_dequantized() -> None:
    torch.manual_seed(0)
    cache = Int8KV(torch.zeros(4, 8, 2, 16, dtype=torch.int8), torch.ones(4, 8, 2), torch.float32)
    x = torch.randn(3, 2, 16)
    slots = torch.tensor([9, 30, 0])  # block 1 offset 1, block 3 offset 6, block 0 offset 0
    write_slots(cache, slots, x)
    blocks = cache.index_select(0, torch.tensor([3, 1, 0]))
    assert blocks.shape == (3, 8, 2, 16) and blocks.dtype == torch.float32
    for got, want in ((blocks[1, 1], x[0]), (blocks[0, 6], x[1]), (blocks[2, 0], x[2])):
        torch.testing.assert_close(got, want, atol=x.abs().max().item() / 127, rtol=0)
    assert blocks[1, 0].eq(0).all()  # unwritten slots stay zero
    with pytest.raises(ValueError, match="whole blocks"):
        cache.index_select(1, torch.tensor([0]))


@needs_c_compiler
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [(8, 4, 64, 8, None), (4, 4, 32, 16, None), (9, 3, 80, 8, None), (16, 1, 128, 5, 50)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@DECOMPOSITIONS
def test_int8_decode_kernel_equals_the_reference_on_the_same_codes(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
    lens: list[int],
) -> None:
    """The kernel reads codes and scales in place; the reference dequantizes the same codes."""
    q, k, v, group = scattered_decode(lens, heads, kv_heads, head_dim, block_size, dtype)
    k8, v8 = as_int8(k.float(), dtype), as_int8(v.float(), dtype)
    meta = AttentionMetadata([(k8, v8)], torch.empty(0), [], [group], ReferenceBackend())
    expected = ReferenceBackend().attend(q, k8, v8, meta, head_dim**-0.5, window)
    got = cpu_attention.PagedCPUBackend().attend(q, k8, v8, meta, head_dim**-0.5, window)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    on_float = ReferenceBackend().attend(q, k, v, meta, head_dim**-0.5, window)
    assert not torch.equal(on_float, expected)  # the codes are read, not a float copy


def test_sdpa_on_an_int8_cache_equals_the_reference_for_prefill_chunks_and_decodes() -> None:
    torch.manual_seed(0)
    block_size = 4
    shape = (64, block_size, 2, 16)
    k, v = as_int8(torch.randn(shape)), as_int8(torch.randn(shape))
    prefills = [
        SequenceSlice(0, 5, 5, torch.arange(0, 2)),
        SequenceSlice(5, 11, 20, torch.arange(2, 7)),
    ]
    lens = [3, 13, 40]
    tables = [list(range(10 + 12 * i, 22 + 12 * i)) for i in range(3)]
    groups = decode_groups([11, 12, 13], tables, lens, block_size, 2, torch.device("cpu"))
    q = torch.randn(14, 4, 16)
    meta = AttentionMetadata([(k, v)], torch.empty(0), prefills, groups, ReferenceBackend())
    expected = ReferenceBackend().attend(q, k, v, meta, 0.25)
    torch.testing.assert_close(SDPABackend().attend(q, k, v, meta, 0.25), expected)


def make_engine(
    model_dir: Path, kv_cache_dtype: str = "int8", backend: str = "auto", **cache: int
) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend=backend),
        CacheConfig(block_size=16, kv_cache_dtype=kv_cache_dtype, **cache),  # type: ignore[arg-type]
        SchedulerConfig(max_num_batched_tokens=256),
    )


def test_int8_kv_fits_4d_over_d_plus_4_times_the_float32_tokens_in_the_same_budget(
    model_dirs: dict[str, Path],
) -> None:
    """The tiny Llama (2 layers x 2 KV heads x head dim 16), K and V: float32 2 x 2 x 2 x 16 x 4
    = 512 bytes a token, int8 2 x 2 x 2 x (16 + 4) = 160: 3.2x the tokens (3.76x at head dim
    64)."""
    budget = 1 << 20
    float32 = make_engine(model_dirs["llama"], "auto", kv_cache_bytes=budget)
    int8 = make_engine(model_dirs["llama"], "int8", kv_cache_bytes=budget)
    assert float32.runner.layout.bytes_per_token() == 512
    assert int8.runner.layout.bytes_per_token() == 160
    assert float32.runner.num_blocks == budget // (512 * 16)
    assert int8.runner.num_blocks == budget // (160 * 16)
    caches = [c for pair in int8.runner.kv_caches for c in pair]
    assert all(isinstance(c, Int8KV) for c in caches)
    assert all(c.data.dtype == torch.int8 and c.scales.dtype == torch.float32 for c in caches)
    cache_bytes = sum(c.data.nbytes + c.scales.nbytes for c in caches)
    null_block = 160 * 16  # block 0, never handed out: padding points at it
    assert cache_bytes == int8.runner.kv_bytes + null_block and int8.runner.kv_bytes <= budget


@pytest.fixture(scope="module")
def int8_model_dirs(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The test models, and the tiny Gemma 3 with key-norm gains like Gemma 3 270M's (a few
    channels 20x the rest), so its keys are stored smoothed (`key_smoothing` is 1 at the
    norms' initial zero weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("gemma3-outlier-keys")
    model = AutoModelForCausalLM.from_pretrained(model_dirs["gemma3"], dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.self_attn.k_norm.weight
            weight.copy_(torch.randn_like(weight) * 0.3)
            weight[[3, 11]] = torch.tensor([19.0, -25.0])
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dirs["gemma3"]).save_pretrained(out)
    return {**model_dirs, "gemma3-outlier-keys": out}


def test_key_smoothing_is_the_key_norms_gain_per_rotary_pair_in_powers_of_two(
    int8_model_dirs: dict[str, Path],
) -> None:
    from transformers import AutoModelForCausalLM

    from serve.model.kv_cache import layer_key_smoothing

    gemma = AutoModelForCausalLM.from_pretrained(int8_model_dirs["gemma3-outlier-keys"])
    smoothing = layer_key_smoothing(gemma)
    assert sorted(smoothing) == [0, 1]
    gain = (1 + gemma.model.layers[0].self_attn.k_norm.weight.detach()).abs()  # Gemma: 1 + w
    pair = ((gain[:8] ** 2 + gain[8:] ** 2) / 2).sqrt()
    want = torch.exp2(torch.round(torch.log2(pair)))
    assert torch.equal(smoothing[0], torch.cat([want, want]))
    assert smoothing[0][3] == smoothing[0][11] == 16.0  # the outlier pairs: sqrt(400 / 2), 26
    llama = AutoModelForCausalLM.from_pretrained(int8_model_dirs["llama"])
    assert layer_key_smoothing(llama) == {0: None, 1: None}  # no k_norm: stored as they are


def test_smoothed_keys_round_closer_where_a_few_channels_dominate() -> None:
    """Keys with two channels 16x the rest: stored divided by the smoothing, the other channels'
    rounding error falls by an order of magnitude (one scale per vector no longer spans the
    dominant two), the whole vector's by half."""
    torch.manual_seed(0)
    smoothing = torch.ones(32)
    smoothing[[2, 18]] = 16.0
    keys = torch.randn(40, 2, 32) * smoothing
    rest = smoothing == 1
    errors = []
    for smooth in (None, smoothing):
        cache = Int8KV(
            torch.zeros(5, 8, 2, 32, dtype=torch.int8), torch.ones(5, 8, 2), torch.float32, smooth
        )
        write_slots(cache, torch.arange(40), keys)
        error = cache.index_select(0, torch.arange(5)).flatten(0, 1) - keys
        errors.append((error[..., rest].pow(2).mean().sqrt(), error.pow(2).mean().sqrt()))
    (plain_rest, plain_all), (smooth_rest, smooth_all) = errors
    assert smooth_rest < plain_rest / 6 and smooth_all < plain_all * 0.6, errors


@pytest.mark.parametrize("backend", [PAGED_CPU, "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma3-outlier-keys"])
def test_int8_kv_engine_equals_generate_over_keys_and_values_rounded_as_stored(
    arch: str, backend: str, int8_model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """`generate` with attention over keys and values rounded to int8 per token and KV head
    (`evals.int8_kv`, what the recipe's int8-KV variants are scored with, set on a loaded model
    as the evals set it) gives the int8-cache engine's tokens."""
    from transformers import AutoModelForCausalLM

    from evals.int8_kv import with_kv_cache_dtype

    model = AutoModelForCausalLM.from_pretrained(int8_model_dirs[arch], dtype=torch.float32).eval()
    model = with_kv_cache_dtype(model, "int8")
    expected = []
    with torch.inference_mode():
        for case in cases[:12]:
            ids = torch.tensor([case.prompt])
            out = model.generate(ids, max_new_tokens=case.max_tokens, do_sample=False)
            expected.append(out[0, ids.shape[1] :].tolist())
    outputs = run(make_engine(int8_model_dirs[arch], backend=backend, num_blocks=512), cases[:12])
    assert_equal(outputs, expected, list(range(12)))


@pytest.mark.parametrize("backend", [PAGED_CPU, "sdpa"])
def test_int8_kv_gives_the_same_tokens_whatever_the_engine_does(
    backend: str, model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """Preemption (a 40-block pool), prefix-cache hits (the cases again) and chunked prefill
    reuse or recompute the same codes: outputs equal a run with ample KV."""
    ample = run(make_engine(model_dirs["llama"], backend=backend, num_blocks=512), cases)
    tight = make_engine(model_dirs["llama"], backend=backend, num_blocks=40)
    assert_equal(run(tight, cases), [ample[i] for i in range(len(cases))], list(range(len(cases))))
    assert tight.stats().num_preemptions > 0
    again = run(tight, cases[:8])
    assert_equal(again, [ample[i] for i in range(8)], list(range(8)))


def test_int8_kv_stays_within_a_tolerance_of_the_float_cache(
    tiny_model_dir: Path, cases: list[Case]
) -> None:
    """On the trained tiny demo model, teacher-forced over the same prompts: the prompt tokens'
    log-probabilities within 0.02 nats on average of the float cache's (and not equal: the codes
    are used), the top-1 token the same at >= 97% of positions."""
    prompts = [c.prompt for c in cases if len(c.prompt) > 8][:12]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)

    def teacher_forced(engine: LLMEngine) -> tuple[torch.Tensor, torch.Tensor]:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        positions: dict[int, list[tuple[float, int]]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    ids = prompts[int(out.request_id)]
                    positions[int(out.request_id)] = [
                        (lp[t], max(lp, key=lp.__getitem__))
                        for t, lp in zip(ids[1:], out.prompt_logprobs[1:])
                        if lp
                    ]
        flat = [x for i in range(len(prompts)) for x in positions[i]]
        return torch.tensor([x[0] for x in flat]), torch.tensor([x[1] for x in flat])

    float_lp, float_top = teacher_forced(make_engine(tiny_model_dir, "auto", num_blocks=512))
    int8_lp, int8_top = teacher_forced(make_engine(tiny_model_dir, "int8", num_blocks=512))
    assert len(float_lp) == sum(len(p) - 1 for p in prompts)
    difference = (float_lp - int8_lp).abs()
    assert difference.mean() < 0.02 and difference.max() > 0
    assert (float_top == int8_top).float().mean() >= 0.97


@needs_c_compiler
def test_paged_cpu_refuses_an_int8_key_cache_beside_a_float_value_cache() -> None:
    q, k, v, group = scattered_decode([5, 9], 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="a cache of their dtype or int8"):
        cpu_attention.PagedCPUBackend().attend_decodes(q, as_int8(k), v, group, 0.25)
