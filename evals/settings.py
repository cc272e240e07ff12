"""What a recipe's `evals:` section says to measure: lm-eval tasks, divergence against a
reference variant, chat answers, the server check and the load benchmark.

Every model forbids unknown keys (the recipe's error lines name the field path); task names and
data set names are checked against what is installed here, so `workbench validate` refuses what
the evals could not run.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from serve.core.config import INT8_KV_VERSION, KVCacheDtype  # engine-core: loads no torch

Slug = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Slo(_Strict):
    """Latency bounds a deployment must keep (seconds, 95th percentiles over a point's requests;
    ITL over all their token gaps). A point meets the SLO when every bound given holds and no
    request failed."""

    ttft_p95_s: PositiveFloat | None = None
    itl_p95_s: PositiveFloat | None = None
    e2e_p95_s: PositiveFloat | None = None

    @model_validator(mode="after")
    def _some_bound(self) -> Slo:
        if not self.bounds():
            raise ValueError("an slo needs at least one of ttft_p95_s, itl_p95_s, e2e_p95_s")
        return self

    def bounds(self) -> dict[str, float]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class LoadEval(_Strict):
    concurrency: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default=[1, 2, 4, 8, 16, 32, 64, 128], min_length=1, max_length=64
    )
    """Concurrent clients to ramp through."""
    prompt_len: list[PositiveInt] = Field(default=[64, 256, 1024], min_length=1, max_length=16)
    """Prompt lengths in tokens."""
    max_tokens: PositiveInt = 64
    """Output tokens per request (with the longest prompt_len: within the base's positions)."""
    requests_per_client: PositiveInt = Field(default=2, le=10_000)
    """Requests each client sends back to back: a point has max(this x concurrency, 8)."""
    requests_per_point: PositiveInt | None = Field(default=None, le=100_000)
    """A fixed number of requests per point instead."""
    kv_cache_memory: str | None = Field(default=None, pattern=r"^\d+(\.\d+)?\s*([KMG]i?B)?$")
    """The server's KV cache budget, e.g. 8MiB (default: the server's own)."""
    max_num_seqs: PositiveInt = Field(default=256, le=65_536)
    """The server's running-request cap: above the ramp's top, so the KV cache is the limit."""
    request_rates: list[PositiveFloat] = Field(default=[], max_length=64)
    """Open-loop points per prompt length: Poisson arrivals at these rates (requests/s)."""
    requests_per_rate_point: PositiveInt = Field(default=32, le=100_000)
    """Requests sent at each open-loop point (the SLO search's too)."""
    slo: Slo | None = None
    """Capacity under these bounds per prompt length: the highest ramp concurrency, and (by a
    search over Poisson request rates) the highest rate, whose points meet them."""
    slo_search_steps: PositiveInt = Field(default=6, le=20)
    """Rates measured by the SLO search per prompt length, at most (halving from the ramp's peak
    request throughput, then bisecting; never above that peak: the search ends when the peak
    meets the SLO)."""


class ServeSettings(_Strict):
    """How the bundled server serves a variant beyond its weights (a variant's `serve:`). The
    variant is its artifact served this way, so every figure of it is measured so: its load
    ramp on a server started with these flags, its lm-eval scores and divergence through the
    same arithmetic (`evals.int8_kv`). Settings left at their defaults change no stored key."""

    kv_cache_dtype: KVCacheDtype = "auto"
    """The server's `--kv-cache-dtype`: `int8` stores keys and values as int8 codes with a
    float32 scale per token and KV head (about 4x the float32 tokens in the same budget)."""

    def flags(self) -> list[str]:
        """The server flags these settings add."""
        return [] if self.kv_cache_dtype == "auto" else ["--kv-cache-dtype", self.kv_cache_dtype]

    def key(self) -> list[Any]:
        """The settings as JSON values for stored-result keys; [] at the defaults, so a plain
        variant's stored results keep their keys."""
        changed = self.model_dump(mode="json", exclude_defaults=True)
        if self.kv_cache_dtype == "int8":
            changed["int8_kv_version"] = INT8_KV_VERSION
        return [changed] if changed else []

    def describe(self) -> str:
        """`serve(kv int8)`, or "" at the defaults."""
        return "" if self.kv_cache_dtype == "auto" else f"serve(kv {self.kv_cache_dtype})"


class QualityTask(_Strict):
    task: Slug
    limit: PositiveInt | None = None
    """Score a random subset of this many documents (of each subtask, for a group)."""
    seed: int = 0
    """Draws the subset."""
    source: Literal["auto", "bundled", "hub"] = "auto"
    """A standard task's data: the hub copy in the HF cache, or the bundled one (auto: the hub
    copy when cached)."""


class DivergenceEval(_Strict):
    reference: Slug = "base"
    """The variant every other one is compared with (KL, top-1 agreement)."""
    data: list[str] = Field(default=["corpus"], min_length=1, max_length=32)
    """Named data sets whose validation split is scored (corpus, shakespeare, ...)."""
    windows: PositiveInt = Field(default=32, le=100_000)
    """Windows scored per data set."""
    seq_len: PositiveInt = 128
    """Tokens per window."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Both models' float dtype (bfloat16 rounding alone moves KL and agreement: keep float32
    when comparing quantizations)."""

    @field_validator("data")
    @classmethod
    def _known_data(cls, names: list[str], info: ValidationInfo) -> list[str]:
        named = (info.context or {}).get("data", {})
        unknown = [n for n in names if n not in named]
        if unknown:
            allowed = ", ".join(named) or "(none given)"
            raise ValueError(f"unknown data set(s) {unknown}; allowed: {allowed}")
        return names


def _as_spec(task: str | QualityTask) -> QualityTask:
    """A quality task written as a bare name, or in full."""
    return QualityTask(task=task) if isinstance(task, str) else task


class Evals(_Strict):
    quality: list[Slug | QualityTask] = Field(default=[], max_length=256)
    """lm-eval tasks: ours from `evals/tasks/`, or lm-eval's standard ones by name (hellaswag,
    piqa, arc_easy, mmlu_<subject>, ...); a name, or {task, limit, seed, source}."""
    max_length: PositiveInt | None = None
    """Longest context lm-eval scores (the rolling-perplexity window); default: the base's
    `max_position_embeddings`, at most 2048."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """The float dtype lm-eval scores in (bfloat16 halves its time on CPUs with avx512_bf16,
    and is emulated, 4x slower, on AVX2-only ones); `auto`: bfloat16 where it is fast."""
    batch_size: PositiveInt = Field(default=16, le=4096)
    """lm-eval's batch size."""
    backend: Literal["hf", "engine"] = "hf"
    """What lm-eval scores through: `hf`, the model in transformers (HFLM, the head projected only
    where lm-eval reads it); `engine`, the workbench's own engine (`evals.engine_lm`: paged KV
    cache, a context shared by its choices through the prefix cache, continuous batching)."""
    divergence: DivergenceEval | None = None
    """KL divergence and top-1 agreement of each variant against a reference variant."""
    chat_prompts: list[str] = Field(default=[], max_length=256)
    """User messages every variant answers greedily through its server (shown side by side)."""
    chat_max_tokens: PositiveInt = Field(default=48, le=131_072)
    server_check_docs: int = Field(default=8, ge=0, le=10_000)
    """Documents per task scored both in-process and through the server (0: no check)."""
    load: LoadEval | None = None
    """Load benchmark settings; no load benchmark when absent."""

    @property
    def run_the_engine(self) -> bool:
        """Whether measuring runs the workbench's engine: lm-eval through it, or a server."""
        engine_lm = bool(self.quality) and self.backend == "engine"
        return engine_lm or self.load is not None or bool(self.chat_prompts)

    @field_validator("quality")
    @classmethod
    def _known_tasks(cls, tasks: list[str | QualityTask]) -> list[str | QualityTask]:
        from evals.quality import TaskRequest, check_task

        problems, seen = [], set()
        for t in tasks:
            spec = _as_spec(t)
            if spec.task in seen:
                problems.append(f"task {spec.task!r} is listed twice")
            seen.add(spec.task)
            try:
                check_task(TaskRequest(spec.task, source=spec.source))
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))
        return tasks

    def task_requests(self) -> list[Any]:
        """The quality tasks as `evals.quality.TaskRequest`s."""
        from evals.quality import TaskRequest

        specs = map(_as_spec, self.quality)
        return [TaskRequest(s.task, s.limit, s.seed, s.source) for s in specs]

    def quality_key(self) -> list[Any]:
        """The quality settings as JSON values, for cache keys."""
        tasks = [t if isinstance(t, str) else t.model_dump() for t in self.quality]
        return [
            tasks,
            self.quality_dtype(),
            self.batch_size,
            *([self.backend] if self.backend != "hf" else []),
        ]

    def length_problems(self, position_limit: int | None) -> list[str]:
        """Lengths the base cannot take (past its `position_limit` positions): each names the
        field, the value and the limit. None: the base states no limit."""
        if position_limit is None:
            return []
        where = f"the base's position limit ({position_limit} positions)"
        problems = []
        if self.max_length is not None and self.max_length > position_limit:
            problems.append(
                f"evals.max_length: {self.max_length} is past {where}; use {position_limit} or less"
            )
        if self.divergence is not None and self.divergence.seq_len > position_limit:
            problems.append(
                f"evals.divergence.seq_len: {self.divergence.seq_len} is past {where}; use "
                f"{position_limit} or less"
            )
        if self.load is not None:
            longest = max(self.load.prompt_len) + self.load.max_tokens
            if longest > position_limit:
                problems.append(
                    f"evals.load: the longest prompt_len ({max(self.load.prompt_len)}) + "
                    f"max_tokens ({self.load.max_tokens}) = {longest} is past {where}; shorten "
                    "them"
                )
        if self.chat_prompts and self.chat_max_tokens >= position_limit:
            problems.append(
                f"evals.chat_max_tokens: {self.chat_max_tokens} leaves no room for a prompt in "
                f"{where}"
            )
        return problems

    def quality_dtype(self) -> str:
        """`dtype` as this machine runs it (`auto` resolved)."""
        if self.dtype != "auto":
            return self.dtype
        from compress.training import fast_bf16

        return "bfloat16" if fast_bf16() else "float32"

    def task_names(self) -> list[str]:
        return [_as_spec(t).task for t in self.quality]
