"""Engine configuration: small frozen dataclasses, one per component, each field documented."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: int | None = None
    """Most tokens (prompt + output) of one request; None: the model's own position limit
    (`max_position_embeddings` or the equivalent; 2048 when its config states none)."""
    enable_prefix_caching: bool = True
    """Share the KV blocks of common prompt prefixes between requests."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 8
    """Tokens per KV block. 8 kept KV waste under 1% on the demo workload (16: about 2%) at
    no throughput cost on the CPU."""
    kv_cache_bytes: int | None = None
    """KV memory budget in bytes; None: `kv_cache_memory_fraction` of free memory on CUDA,
    256 MiB on the CPU."""
    kv_cache_memory_fraction: float = 0.5
    """Fraction of free GPU memory for KV when `kv_cache_bytes` is None (CUDA only)."""
    num_blocks: int | None = None
    """Exact number of blocks; overrides the byte budget (tests use it)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")


ATTENTION_BACKENDS = ("auto", "paged-cpu", "sdpa", "reference")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """A local HF model dir or a hub id."""
    dtype: str = "auto"
    """float32, bfloat16 or float16; auto: bfloat16 on CUDA, float32 on the CPU."""
    device: str = "auto"
    """cpu, cuda or cuda:N; auto: cuda when available."""
    attention_backend: str = "auto"
    """`paged-cpu` (C kernel reading KV blocks in place: CPU, float32 or bfloat16, needs a C
    compiler), `sdpa` (gathered blocks, any device) or `reference` (plain per-sequence loop);
    auto: paged-cpu where it runs, else sdpa."""
    prepack_linears: bool = True
    """On the CPU in float32 or bfloat16: run plain linear layers through oneDNN with prepacked
    weights (`serve/cpu_linear.py`); False keeps `F.linear`."""
    compile: bool = False
    """Run each step's forward through `torch.compile` (`serve/compilation.py`): graphs for the
    step shapes are compiled at load (seconds to minutes), float models without LoRA only."""


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
