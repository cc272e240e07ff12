"""The model runner: owns the model and the KV tensors, turns a `SchedulerOutput` into logits.

Model: all scheduled tokens of a step form one flat row (`input_ids`, `positions`); the paged
attention function finds each sequence's rows, slots and blocks in the `AttentionMetadata` built
here once per step. Logits are computed only at the rows that sample (each sampling chunk's last
token), through the model's own head (`logits_to_keep`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from compress.artifact import check_intact
from compress.load_model import load_model as load_artifact
from compress.load_spec import own_dtype
from serve.core.config import (
    ATTENTION_BACKENDS,
    CacheConfig,
    KVCacheDtype,
    ModelConfig,
    SchedulerConfig,
)
from serve.core.kv_cache_manager import cdiv
from serve.core.scheduler import SchedulerOutput
from serve.lora.adapter import Adapter
from serve.lora.layers import StepSlots, lora_step_context
from serve.lora.registry import AdapterRegistry
from serve.lora.slots import AdapterSlots
from serve.model import cpu_attention
from serve.model.attention import ATTENTION_NAME, AttentionBackend, step_context
from serve.model.compilation import CompiledForward, CompileReport, warm_up
from serve.model.flex_attention import cuda_backend
from serve.model.graph_runner import GraphedDecodes
from serve.model.graphs import CUDAGraphBackend, GraphBackend, why_not_graphable
from serve.model.input_buffers import BufferLimits, StepBuffers
from serve.model.kv_cache import KVLayout, allocate, layer_key_smoothing
from serve.model.sdpa_attention import ReferenceBackend, SDPABackend
from serve.model.step_inputs import StepInputs, build_step_inputs

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_BYTES = 256 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but CUDA is not available here; use cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported; use cpu, cuda or cuda:N")
    return device


def position_limit(model: PreTrainedModel) -> int | None:
    """The most positions the model can encode, as its config states it (None: unstated)."""
    return config_position_limit(model.config)


def config_position_limit(config: PretrainedConfig) -> int | None:
    """`position_limit` from a model's config alone."""
    config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def resolve_dtype(name: str, device: torch.device, model: str | None = None) -> torch.dtype:
    """`auto`: the dtype `model`'s format computes in (int4-wo: bfloat16), else bfloat16 on CUDA
    and float32 on the CPU."""
    if name == "auto":
        own = own_dtype(model) if model is not None else None
        return own or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def kv_layout(
    model: PreTrainedModel, dtype: torch.dtype, kv_cache_dtype: KVCacheDtype = "auto"
) -> KVLayout:
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVLayout(config.num_hidden_layers, kv_heads, head_dim, dtype, kv_cache_dtype)


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    path = Path(config.model)
    if path.is_dir():
        check_intact(path)
    source = str(path) if path.exists() else config.model
    return load_artifact(source, dtype=dtype, device=device, attn_implementation=ATTENTION_NAME)


def buffer_limits(scheduler: SchedulerConfig, cache: CacheConfig, num_blocks: int) -> BufferLimits:
    """The step buffers' sizes: the token budget, the most running requests, and the blocks of
    the longest context (max_model_len, or the whole cache when that is smaller)."""
    assert scheduler.max_model_len is not None, "resolve the scheduler config first"
    blocks = min(cdiv(scheduler.max_model_len, cache.block_size), num_blocks)
    tokens = max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
    return BufferLimits(tokens, scheduler.max_num_seqs, blocks)


def make_backend(
    name: str, model: PreTrainedModel, device: torch.device, layout: KVLayout, block_size: int
) -> AttentionBackend:
    """auto: on CUDA `flex` where it runs, else `padded-sdpa` (`flex_attention.cuda_backend`);
    on the CPU `paged-cpu` where its kernel runs (float32 or bfloat16, a C compiler), else `sdpa`.
    An explicit `paged-cpu` that cannot run is refused with the reason; only these two names
    build the kernel."""
    if one_call := cuda_backend(name, device, block_size, layout.head_dim):
        return one_call
    if name in ("auto", "paged-cpu"):
        heads = model.config.get_text_config().num_attention_heads
        why_not = cpu_attention.unsupported_reason(
            device, layout.dtype, heads, layout.num_kv_heads, layout.head_dim
        )
        if name == "paged-cpu" and why_not:
            raise ValueError(
                f"the paged-cpu attention backend cannot run here: {why_not}; "
                "use --attention-backend sdpa"
            )
        if not why_not:
            return cpu_attention.PagedCPUBackend()
        name = "sdpa"
    if name == "sdpa":
        return SDPABackend()
    if name == "reference":
        return ReferenceBackend()
    raise ValueError(
        f"attention backend {name!r} is unknown; use one of {', '.join(ATTENTION_BACKENDS)}"
    )


@dataclass(frozen=True)
class RunnerOptions:
    """How the runner executes a step (the model and cache sizes aside)."""

    attention_backend: str = "auto"
    """A `ModelConfig.attention_backend` name."""
    compile_model: bool = False
    """The step forward through `torch.compile` (`--compile`)."""
    lora: AdapterRegistry[Adapter] | None = None
    """Serve the registry's LoRA adapters (None: the base model only)."""
    cuda_graphs: bool = False
    """On CUDA, replay decode steps from captured graphs (`serve/model/graphs.py`)."""


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        device: torch.device,
        options: RunnerOptions | None = None,
    ) -> None:
        """`scheduler`: resolved (`max_model_len` set): it sizes the persistent step buffers."""
        options = options or RunnerOptions()
        self.model, self.device, self.block_size = model, device, cache.block_size
        # the float parameters' dtype
        self.layout = kv_layout(model, model.dtype, cache.kv_cache_dtype)
        self.backend = make_backend(
            options.attention_backend, model, device, self.layout, cache.block_size
        )
        self.num_blocks = self._num_blocks(cache)
        """KV blocks requests can use (the budget's); the KV tensors hold one more, the null
        block 0, which padding points at."""
        smoothing = layer_key_smoothing(model) if cache.kv_cache_dtype == "int8" else None
        self.kv_caches = allocate(
            self.layout, self.num_blocks + 1, cache.block_size, device, smoothing
        )
        self.buffers = StepBuffers(
            buffer_limits(scheduler, cache, self.num_blocks), self.block_size, device
        )
        lora = options.lora
        self.lora_slots = (
            AdapterSlots(model, lora.config, device, self.layout.dtype, lora.versions)
            if lora
            else None
        )
        """The LoRA layers wrapped around the model's linears and their device slots."""
        self.graphs: GraphedDecodes | None = None
        """The captured decode graphs; None: every step runs eagerly."""
        self.compiled: CompiledForward | None = None
        """The forward through `torch.compile` (`--compile`); None: the model is called as is."""
        self.compile_report: CompileReport | None = None
        if options.compile_model:
            self.compiled = CompiledForward(model)
            self.compile_report = warm_up(
                self.compiled, self.execute, self.block_size, self.num_blocks
            )
        if options.cuda_graphs and device.type == "cuda" and self.compiled is None:
            why = why_not_graphable(model, self.backend.static_decodes)
            if why is None:
                self.enable_graphs(CUDAGraphBackend(), scheduler.max_num_seqs)
            else:
                log.warning(
                    "decode steps run eagerly: CUDA graphs cannot serve this model: %s", why
                )

    def _num_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        budget = cache.kv_cache_bytes
        available = available_memory(self.device)
        if budget is None and self.device.type == "cuda":
            assert available is not None  # CUDA always reports its free memory
            budget = int(available * cache.kv_cache_memory_fraction)
        budget = budget or CPU_DEFAULT_KV_BYTES
        if available is not None and budget > available:
            raise ValueError(
                f"a KV cache of {budget / 2**20:.1f} MiB does not fit in the "
                f"{available / 2**20:.1f} MiB still free on {self.device}; "
                "give a smaller --kv-cache-memory"
            )
        num = budget // (self.layout.bytes_per_token() * cache.block_size)
        if num < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes holds no block of {cache.block_size} tokens "
                f"({self.layout.bytes_per_token() * cache.block_size} bytes); give more KV memory"
            )
        return num

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV blocks requests can use (within the budget; the null block's one
        block more is not counted)."""
        return self.num_blocks * self.block_size * self.layout.bytes_per_token()

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        return build_step_inputs(out, self.buffers, self.kv_caches, self.backend)

    def enable_graphs(self, backend: GraphBackend, max_num_seqs: int) -> None:
        """Capture decode graphs for batches of up to `max_num_seqs` sequences with `backend`;
        from now on decode-only steps replay them. Raises ValueError naming why a model or
        backend cannot be captured."""
        if self.compiled is not None:
            raise ValueError(
                "decode graphs cannot serve this model: the forward runs through torch.compile; "
                "use --enforce-eager or drop --compile"
            )
        self.graphs = GraphedDecodes(
            self.model,
            self.buffers,
            self.kv_caches,
            self.backend,
            backend,
            max_num_seqs,
            lora=self.lora_slots is not None,
        )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, lora: StepSlots | None = None) -> torch.Tensor:
        """Float32 logits at `inputs.logits_rows`: [len(logits_rows), vocab]; the attention
        metadata and the step's adapters travel in the step's forward contexts."""
        if self.graphs is not None and (bucket := self.graphs.bucket(inputs, lora)) is not None:
            return self.graphs.run(inputs, bucket, lora)
        rows: torch.Tensor | int = inputs.logits_rows
        if self.compiled is None and len(inputs.logits_rows) == len(inputs.input_ids):
            rows = 0  # every row, ascending (a decode-only step): a view, not a gather
        with step_context(inputs.meta), lora_step_context(lora):
            call = self.compiled if self.compiled is not None else self.model
            result = call(
                input_ids=inputs.input_ids[None],
                position_ids=inputs.positions[None],
                use_cache=False,
                logits_to_keep=rows,
            )
        return result.logits[0].float()

    def execute(self, out: SchedulerOutput) -> tuple[StepInputs, torch.Tensor]:
        """One step's model half: flatten the scheduled chunks, give their adapters device
        slots, run the model; (the step's inputs, the logits at its `logits_rows`). The inputs
        are made in inference mode whatever the caller's mode, so a compiled forward always
        meets tensors of the kind its warm-up compiled for (a mismatch fails its guards and
        runs it eagerly)."""
        with torch.inference_mode():
            inputs = self.prepare(out)
            lora = None
            if self.lora_slots is not None:
                lora = self.lora_slots.prepare_step(inputs.adapter_rows, out.num_tokens)
        return inputs, self.forward(inputs, lora)
