"""What the evals hand to the report, typed: per variant its lm-eval scores, its divergence from
the reference variant, its load benchmark and its chat answers; per run the server check.

Each is a `compress.record.Record`: stored in `<work dir>/evals/<variant>/*.json` and in
`report.json` as exactly the JSON its `to_json` gives (the keys the report and the dashboard read).
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

from compress.record import Omitted, Record


class TaskScore(Record):
    """One lm-eval task's headline metrics: accuracy for multiple choice, perplexities for
    rolling loglikelihood; each with its standard error where lm-eval gives one."""

    word_perplexity: Omitted[float] = None
    word_perplexity_stderr: Omitted[float] = None
    byte_perplexity: Omitted[float] = None
    byte_perplexity_stderr: Omitted[float] = None
    bits_per_byte: Omitted[float] = None
    bits_per_byte_stderr: Omitted[float] = None
    acc: Omitted[float] = None
    acc_stderr: Omitted[float] = None
    acc_norm: Omitted[float] = None
    acc_norm_stderr: Omitted[float] = None
    samples: float
    """Documents scored (a group: the sum over its subtasks)."""
    source: Omitted[str] = None
    """A standard task's data: `hub` or `bundled`."""
    split: Omitted[str] = None
    data: Omitted[str] = None

    def metric(self, name: str) -> float | None:
        return getattr(self, name, None)


class ItemScores(Record):
    """One task's per-document scores, for paired comparisons between variants scored on the
    same documents: `ids[i]` (`<leaf task>/<doc id>`) names the document whose scores are at
    index i of every list. Multiple choice: `acc` / `acc_norm` (1 right, 0 wrong); rolling
    loglikelihood: the document's summed `loglikelihood` and its UTF-8 `bytes`."""

    ids: list[str]
    acc: Omitted[list[float]] = None
    acc_norm: Omitted[list[float]] = None
    loglikelihood: Omitted[list[float]] = None
    bytes: Omitted[list[int]] = None

    def metric(self, name: str) -> list[float] | None:
        return getattr(self, name, None)


class QualityResult(Record):
    tasks: dict[str, TaskScore]
    items: Omitted[dict[str, ItemScores]] = None
    """By task; kept in the work dir for the report's paired comparisons, not in report.json."""
    max_length: int
    dtype: str
    lm_eval_version: str
    seconds: float


class DivergenceStats(Record):
    """A variant's next-token distribution against the reference's on one data set."""

    kl_mean: float
    kl_stderr: float
    kl_median: float
    kl_p99: float
    top1_agreement: float
    top1_agreement_stderr: float
    perplexity: float
    reference_perplexity: float
    bits_per_byte: float
    reference_bits_per_byte: float
    windows: int
    tokens: int
    window_kl: Omitted[list[float]] = None
    """Per window (same order for every variant): mean KL, agreement, and both models' mean NLL
    per token in nats; absent in results stored before they were kept."""
    window_agreement: Omitted[list[float]] = None
    window_nll: Omitted[list[float]] = None
    window_reference_nll: Omitted[list[float]] = None


class DivergenceResult(Record):
    reference: str
    dtype: str
    data: dict[str, DivergenceStats]
    seconds: float


class Percentiles(Record):
    p50: float
    p95: float
    p99: float
    mean: float


class Point(Record):
    """One (concurrency, prompt length) point of the load ramp."""

    concurrency: int
    prompt_len: int
    max_tokens: int
    requests: int
    seconds: float
    request_throughput: float
    output_throughput: float
    ttft: Percentiles
    tpot: Percentiles
    """Seconds per output token after the first."""
    e2e: Percentiles
    peak_kv_usage: float
    peak_waiting: float
    preemptions: float
    kv_full_queued_steps: float
    """Engine steps of this point that ended with requests waiting while KV was >= 90% full."""
    failed: int = 0
    saturated: bool = False
    itl: Omitted[Percentiles] = None
    """Seconds between streamed tokens, over every gap of every request."""
    request_rate: Omitted[float] = None
    """An open-loop point's Poisson arrival rate (req/s); its `concurrency` is the most
    requests in flight at once. None: a closed-loop point of `concurrency` clients."""


class ServerInfo(Record):
    """The served model and its KV cache, as the server's `/metrics` say (None where a foreign
    server does not say)."""

    model: str
    max_model_len: int | None
    kv_blocks: float | None
    block_size: float | None
    kv_bytes_per_token: float | None


class Saturation(Record):
    measured_concurrency: int | None
    """The first concurrency whose requests queued on a full KV cache (None: none did)."""
    estimated_concurrency: float | None
    """KV tokens / (prompt + output tokens)."""


class Capacity(Record):
    """What one prompt length can take within the SLO."""

    slo: dict[str, float]
    concurrency: int | None
    """The highest ramp concurrency whose point met the SLO (None: none did)."""
    request_rate: float | None
    """The highest Poisson request rate the search found meeting the SLO (None: none did)."""
    searched: list[Point]
    """The search's open-loop points, in the order measured."""


class Sitting(Record):
    """When and on what a measurement ran: figures of one machine drift between sittings (a
    2-core VM ran a third faster one day than the day before), so only those measured in one
    sitting compare cleanly."""

    started: str
    """UTC, ISO 8601 to the second."""
    seconds: float
    host: str
    cpu: str
    cpu_count: int

    @classmethod
    def since(cls, started: datetime.datetime, seconds: float) -> Sitting:
        """A measurement that began at `started` (UTC) and took `seconds`, on this machine."""
        return cls(
            started=started.isoformat(timespec="seconds"),
            seconds=round(seconds, 1),
            host=platform.node(),
            cpu=cpu_model(),
            cpu_count=os.cpu_count() or 0,
        )

    def start(self) -> datetime.datetime:
        return datetime.datetime.fromisoformat(self.started)

    def end(self) -> datetime.datetime:
        return self.start() + datetime.timedelta(seconds=self.seconds)


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class LoadResult(Record):
    server: ServerInfo
    kv_tokens: float | None
    points: list[Point]
    saturation: dict[str, Saturation]
    """By prompt length (a string: JSON keys)."""
    rate_points: Omitted[list[Point]] = None
    """Open-loop points at the recipe's request rates."""
    capacity: Omitted[dict[str, Capacity]] = None
    """By prompt length, when an SLO was given."""
    adapter_requests: Omitted[float] = None
    """An adapter variant: requests its server ran with it (proof the adapter, not the base, ran)."""
    measured: Omitted[Sitting] = None
    """When and where the load ran (None: stored by a workbench that did not record it)."""
    measured_on: Omitted[str] = None
    """The variant whose ramp this is, when it is not this one's: a serving twin (same shapes,
    formats and serve settings: `evals.serving_twins`)."""
    gpu: Omitted[str] = None
    """The GPU the server ran on, when it had one (`measured` names the machine); set by
    `workbench run` for the ramps it measures."""

    def every_point(self) -> list[Point]:
        """The ramp's points, then the open-loop ones, then the SLO searches'."""
        searched = [p for c in (self.capacity or {}).values() for p in c.searched]
        return [*self.points, *(self.rate_points or []), *searched]

    def at(self, prompt_len: int, concurrency: int) -> Point | None:
        return next(
            (p for p in self.points if p.prompt_len == prompt_len and p.concurrency == concurrency),
            None,
        )


class ChatAnswer(Record):
    prompt: str
    answer: str
    finish_reason: str | None
    completion_tokens: int


class TaskCheck(Record):
    requests: int
    max_abs_diff: float
    max_rel_diff: float
    ok: bool


class ServerCheck(Record):
    """lm-eval scored through the server against lm-eval in-process, on the first documents."""

    abs_tol: float
    rel_tol: float
    tasks: dict[str, TaskCheck]
    ok: bool
    variant: str
    documents_per_task: int


class VariantEvals(Record):
    """Everything measured for one variant (None: not asked for, or not in this run)."""

    quality: QualityResult | None = None
    divergence: DivergenceResult | None = None
    load: LoadResult | None = None
    answers: list[ChatAnswer] | None = None

    def quality_json(self) -> dict[str, Any] | None:
        """The report's `quality` entry: lm-eval's summary with the divergence beside it."""
        if self.quality is None and self.divergence is None:
            return None
        out = self.quality.to_json() if self.quality else {}
        out.pop("items", None)
        if self.divergence is not None:
            out["divergence"] = self.divergence.to_json()
        return out
