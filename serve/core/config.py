"""Engine configuration: small frozen dataclasses, one per component, each field documented.

These dataclasses are the one source of truth for the engine's settings: their defaults, their
bounds (`Range` / `Size` in a field's `Annotated` type, checked when a config is built) and the
docstring under each field are what `workbench serve` derives its flags and help from
(`serve/http/flags.py`) and what `LLM(model, cache=..., scheduler=..., lora=...)` takes.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal


@dataclass(frozen=True)
class Range:
    """A number in [low, high] (`low_open`: low itself excluded)."""

    low: float
    high: float | None = None
    low_open: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        low = f"({self.low:g}" if self.low_open else f"{self.low:g}"
        if self.high is None:
            return f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        return f"{low}, {self.high:g}]" if self.low_open else f"{low}..{self.high:g}"


@dataclass(frozen=True)
class Size:
    """A byte count; on the command line also `512MiB`, `2GiB`, `1e9`."""


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """A config class's field types, `Annotated` metadata kept (resolved once per class)."""
    return typing.get_type_hints(cls, include_extras=True)


def field_meta(cls: type, name: str) -> list[Any]:
    """The `Annotated` metadata of a config field (Range, Size)."""
    return list(getattr(field_hints(cls)[name], "__metadata__", ()))


def check_fields(config: Any) -> None:
    """Raise ValueError naming the field, the value and what is allowed, for any field outside
    its `Range` (sizes must be >= 1)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None or isinstance(value, bool):
            continue
        for meta in field_meta(type(config), f.name):
            bound = Range(1) if isinstance(meta, Size) else meta
            if isinstance(bound, Range) and not bound.contains(value):
                raise ValueError(f"{f.name} is {value}; allowed: {bound.describe()}")


Positive = Annotated[int, Range(1)]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: Positive = 64
    """Most requests running at once."""
    max_num_batched_tokens: Positive = 1024
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: Annotated[int | None, Range(1)] = None
    """Most tokens (prompt + output) of one request; None: the model's own position limit
    (`max_position_embeddings` or the equivalent; 2048 when its config states none)."""
    enable_prefix_caching: bool = True
    """Share the KV blocks of common prompt prefixes between requests."""
    async_scheduling: bool = False
    """Schedule step N+1 while step N computes on a worker thread (`serve/engine/overlap.py`):
    stops are found a step late and the extra token dropped. Steps of requests with a grammar,
    penalties, min_tokens, logit bias or prompt logprobs, and engines serving LoRA, run one by
    one."""

    def __post_init__(self) -> None:
        check_fields(self)


KVCacheDtype = Literal["auto", "int8"]
INT8_KV_VERSION = 2
"""What the int8 cache computes (2: keys of layers with a k_norm smoothed per channel); stored
evaluations of int8-KV variants carry it, so a change measures them again."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: Annotated[int, Range(1, 1024)] = 16
    """Tokens per KV block (vLLM's default too). Against 8 on a 2-core AVX2 CPU: decode steps
    of 64 sequences 8-10% faster (the decode kernel reads longer runs of keys), KV waste about 2%
    against 1%, prefixes shared in steps of 16 tokens
    (docs/measured/kv-cache.md#2026-12-04-session-23-kv-blocks-of-16)."""
    kv_cache_bytes: Annotated[int | None, Size()] = None
    """KV memory budget in bytes, e.g. 512MiB; None: `kv_cache_memory_fraction` of free memory
    on CUDA, 256 MiB on the CPU."""
    kv_cache_memory_fraction: Annotated[float, Range(0, 1, low_open=True)] = 0.5
    """Fraction of free GPU memory for KV when `kv_cache_bytes` is None (CUDA only)."""
    num_blocks: Annotated[int | None, Range(1)] = None
    """Exact number of KV blocks requests can use (the cache holds one block more, the null
    block 0, which padding points at, with either this or the byte budget); overrides the byte
    budget."""
    kv_cache_dtype: KVCacheDtype = "auto"
    """auto: keys and values stored in the model's dtype; int8: symmetric int8 codes with a
    float32 scale per token and KV head (`serve/model/kv_cache.py`): 1 + 4 / head_dim bytes a
    value, so about 4x the tokens of float32 and 2x those of bfloat16 fit in the same budget."""

    def __post_init__(self) -> None:
        check_fields(self)


AttentionBackend = Literal["auto", "paged-cpu", "flex", "padded-sdpa", "sdpa", "reference"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
ATTENTION_BACKENDS: tuple[str, ...] = typing.get_args(AttentionBackend)


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """A local HF model dir or a hub id."""
    dtype: Dtype = "auto"
    """Weights and KV dtype; auto: the one a variant's format computes in (int4-wo: bfloat16),
    else bfloat16 on CUDA, float32 on the CPU."""
    device: str = "auto"
    """cpu, cuda or cuda:N; auto: cuda when available."""
    attention_backend: AttentionBackend = "auto"
    """`paged-cpu` (C kernel reading KV blocks in place: CPU, float32 or bfloat16, needs a C
    compiler), `flex` (FlexAttention over a block mask, one call a layer for the decodes and one
    for the prefill chunks: compiled Triton on CUDA, eager on the CPU), `padded-sdpa` (the same
    two calls through SDPA over gathered blocks), `sdpa` (gathered blocks, decodes in groups of
    similar lengths, each prefill alone) or `reference` (plain per-sequence loop); auto: on CUDA
    flex where it runs, else padded-sdpa; on the CPU paged-cpu where it runs, else sdpa."""
    prepack_linears: bool = True
    """On the CPU: run plain float32 or bfloat16 linear layers through oneDNN with prepacked
    weights (`serve/model/cpu_linear.py`), and bitsandbytes nf4 / fp4 / int8 ones through the
    engine's kernels where bitsandbytes has none (`serve/model/bnb_linear.py`); False keeps
    `F.linear` and bitsandbytes' own layers."""
    merge_projections: bool = True
    """With `prepack_linears`: q/k/v and gate/up as one prepacked product each."""
    fuse_layers: bool = True
    """On the CPU without `compile`: run the decoder layers of Llama, Mistral, Qwen 2 / 3 and
    Gemma 3 models with their norms, rotary embedding and activation as fused C kernels
    (`serve/model/fused_layers.py`); False keeps transformers' modules."""
    compile: bool = False
    """Run each step's forward through `torch.compile` (`serve/model/compilation.py`): graphs for the
    step shapes are compiled at load (seconds to minutes), float models without LoRA only."""
    enforce_eager: bool = False
    """On CUDA: run every step eagerly. Otherwise decode-only steps of up to `max_num_seqs`
    sequences replay CUDA graphs captured at load, one per batch-size bucket (1, 2, 4, 8, then
    steps of 16; `serve/model/graphs.py`); other steps run eagerly and are counted. The CPU
    runs eagerly either way."""
    generation_config: str = "auto"
    """Default sampling settings (temperature, top_p, top_k, min_p, repetition_penalty,
    max_new_tokens) for fields a request leaves out, and extra end-of-sequence ids: `auto`, from
    the model's generation_config.json; `vllm`, none (the tokenizer's EOS only); or a folder
    holding a generation_config.json."""


DEFAULT_MAX_MODEL_LEN = 2048


def with_model_limit(config: SchedulerConfig, position_limit: int | None) -> SchedulerConfig:
    """`config` with `max_model_len` resolved against the model's position limit; a larger
    explicit value is refused (positions past the limit index past the model's tables)."""
    wanted = config.max_model_len
    if wanted is None:
        return replace(config, max_model_len=position_limit or DEFAULT_MAX_MODEL_LEN)
    if position_limit is not None and wanted > position_limit:
        raise ValueError(
            f"max_model_len {wanted} is larger than the model's position limit "
            f"({position_limit} positions); use --max-model-len {position_limit} or less"
        )
    return config
