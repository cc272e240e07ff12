"""Every figure the report shows, declared once: its row key, label, format, which direction is
better, the table group it belongs to, and how it is paired against the reference variant.

Model: `registry` lists a run's metrics from its tasks, divergence data sets and load settings.
The report's tables (one per group), its columns in report.json (which the dashboard and the CLI
read), the paired comparisons and the recommendation all take their metrics from it, so a label, a
direction or a pairing cannot disagree between them. A task's headline metric is the one lm-eval's
users quote for it (`evals.standard_tasks`), else word perplexity for rolling-loglikelihood tasks
and accuracy for multiple choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from evals import standard_tasks
from evals.results import TaskScore, VariantEvals

Format = Literal["text", "int", "float", "bytes", "pct", "pct100"]
Group = Literal["variant", "memory", "quality", "divergence", "serving"]
GROUPS: dict[Group, str] = {
    "variant": "Variants",
    "memory": "Memory",
    "quality": "Quality (lm-eval)",
    "divergence": "Divergence from the reference",
    "serving": "Serving under load",
}
Pairing = Literal["accuracy", "bits_per_byte", "window_nll"]
"""How a metric's difference against the reference is tested (`evals.paired`): documents' 0/1
scores, documents' loglikelihoods over their bytes, or windows' mean NLL per token."""


@dataclass(frozen=True)
class Family:
    """Row keys of one figure measured at several settings (a prompt length, a data set): the
    prefix, then the setting. Rows are written and read through it, so no other module spells a
    key."""

    prefix: str

    def key(self, setting: object) -> str:
        return f"{self.prefix}{setting}"

    def owns(self, key: str) -> bool:
        """A key of this family's figures (not one of their standard errors)."""
        return key.startswith(self.prefix) and not key.endswith(stderr_key(""))

    def values(self, row: dict[str, Any]) -> dict[str, Any]:
        """{setting: value} of this family's keys in `row` (None values kept)."""
        return {k.removeprefix(self.prefix): v for k, v in row.items() if self.owns(k)}


REFERENCE_CONCURRENCY = 16
"""The concurrency whose p95 latencies the table shows."""
P95_E2E = Family(f"p95_e2e_c{REFERENCE_CONCURRENCY}_p")
P95_ITL = Family(f"p95_itl_c{REFERENCE_CONCURRENCY}_p")
SATURATION = Family("saturation_p")
SATURATION_ESTIMATE = Family("saturation_estimate_p")
CAPACITY_RATE = Family("capacity_rate_p")
"""Per prompt length: the highest request rate whose p95s meet the run's SLO."""
CAPACITY_CONC = Family("capacity_conc_p")
RECOVERY = Family("recovery_")


def stderr_key(key: str) -> str:
    return f"{key}_stderr"


def bits_per_byte_key(task: str) -> str:
    return f"{task}_bits_per_byte"


@dataclass(frozen=True)
class Metric:
    key: str
    """The row key (report.json `variants[].row`)."""
    label: str
    format: Format
    better: Literal["higher", "lower"] | None
    group: Group
    stderr_key: str | None = None
    paired: Pairing | None = None
    source: str | None = None
    """What is paired: the lm-eval task, or the divergence data set."""
    measure: str | None = None
    """The lm-eval metric (acc, acc_norm, word_perplexity) a task column shows."""
    short: str | None = None
    """The label in `workbench run`'s summary table; metrics without one are left out of it."""

    def column(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "label": self.label, "format": self.format}
        if self.format != "text":
            out["better"] = self.better
        if self.stderr_key:
            out["stderr_key"] = self.stderr_key
        if self.short:
            out["short"] = self.short
        return out | {"group": self.group}


def lower_is_better(measure: str) -> bool:
    return "perplexity" in measure


def headline(task: str, score: TaskScore) -> str | None:
    """The lm-eval metric `task` is summarised by, if `score` has it."""
    quoted = standard_tasks.headline_metric(task)
    for name in (quoted, "word_perplexity", "acc") if quoted else ("word_perplexity", "acc"):
        if name is not None and score.metric(name) is not None:
            return name
    return None


def task_score(evals: VariantEvals, task: str) -> TaskScore | None:
    return evals.quality.tasks.get(task) if evals.quality else None


def task_measure(measured: dict[str, VariantEvals], task: str) -> str | None:
    """The headline metric of `task` in the variants' lm-eval results."""
    for evals in measured.values():
        score = task_score(evals, task)
        found = headline(task, score) if score else None
        if found:
            return found
    return None


def _task_label(task: str, measure: str, measured: dict[str, VariantEvals]) -> str:
    """`task (acc_norm, n=200, validation split)`: n and split of the first variant with them."""
    short = "word ppl" if measure == "word_perplexity" else measure
    for evals in measured.values():
        score = task_score(evals, task)
        if score:
            parts = [short, f"n={score.samples:.0f}"]
            if score.split is not None:
                parts.append(f"{score.split} split")
            return f"{task} ({', '.join(parts)})"
    return task


def task_metrics(task: str, measured: dict[str, VariantEvals]) -> list[Metric]:
    measure = task_measure(measured, task)
    if measure is None:
        return []
    lower = lower_is_better(measure)
    shown = Metric(
        task,
        _task_label(task, measure, measured),
        "float" if lower else "pct",
        "lower" if lower else "higher",
        "quality",
        stderr_key=None if lower else stderr_key(task),
        paired="bits_per_byte" if lower else "accuracy",
        source=task,
        measure=measure,
        short=task,
    )
    recovery = Metric(
        RECOVERY.key(task),
        f"{task} recovery{' (bits/byte)' if lower else ''}",
        "pct100",
        "higher",
        "quality",
    )
    return [shown, recovery]


PPL, BPB, KL, AGREE = Family("ppl_"), Family("bpb_"), Family("kl_"), Family("agree_")
DIVERGENCE_STATS = {  # per data set: (`evals.divergence` statistic, its standard error)
    PPL: ("perplexity", None),
    BPB: ("bits_per_byte", None),
    KL: ("kl_mean", "kl_stderr"),
    AGREE: ("top1_agreement", "top1_agreement_stderr"),
}


def divergence_metrics(data: str, reference: str) -> list[Metric]:
    kl, agree = KL.key(data), AGREE.key(data)
    return [
        Metric(PPL.key(data), f"token ppl ({data})", "float", "lower", "divergence",
               paired="window_nll", source=data),
        Metric(BPB.key(data), f"bits/byte ({data})", "float", "lower", "divergence"),
        Metric(kl, f"KL vs {reference} ({data}, nats)", "float", "lower", "divergence",
               stderr_key=stderr_key(kl), source=data),
        Metric(agree, f"top-1 agreement ({data})", "pct", "higher", "divergence",
               stderr_key=stderr_key(agree)),
    ]  # fmt: skip


VARIANT = Metric("variant", "variant", "text", None, "variant", short="variant")
STEPS = Metric("steps", "steps", "text", None, "variant")
SERVES_IN = Metric("serves_in", "serves in", "text", None, "variant")
PARAMETERS = Metric("parameters", "params", "int", None, "memory")
WEIGHT_BYTES = Metric("weight_bytes", "weight memory", "bytes", "lower", "memory",
                      short="weights")  # fmt: skip
KV_BYTES_PER_TOKEN = Metric("kv_bytes_per_token", "KV B/token", "int", "lower", "memory")
MEMORY = [PARAMETERS, WEIGHT_BYTES, KV_BYTES_PER_TOKEN]
PEAK_TOK_S = Metric("peak_output_tok_s", "peak tok/s", "float", "higher", "serving",
                    short="peak tok/s")  # fmt: skip
PEAK_REQ_S = Metric("peak_req_s", "peak req/s", "float", "higher", "serving")
FAILED_REQUESTS = Metric("failed_requests", "failed requests", "int", "lower", "serving")
RAN_ON = Metric("ran_on", "ran on", "text", None, "serving")

KIND, TRAINABLE, BYTES_ON_DISK, KV_TOKENS = (
    "kind", "trainable_parameters", "bytes_on_disk", "kv_tokens"
)  # fmt: skip
"""Row keys no table shows: the manifest's kind, trainable parameters and size on disk, and the
KV cache's token capacity (the recommendation compares twins by it)."""


def serving_metrics(load_settings: dict[str, Any]) -> list[Metric]:
    """Peak throughput and failed requests, then per prompt length: p95 latencies at 16 clients,
    KV saturation, and with an SLO the capacity within it."""
    out = [PEAK_TOK_S, PEAK_REQ_S, FAILED_REQUESTS, RAN_ON]
    slo = load_settings.get("slo")
    bounds = ", ".join(f"{k.removesuffix('_s')} {v:g} s" for k, v in (slo or {}).items() if v)
    c = REFERENCE_CONCURRENCY
    for n in load_settings["prompt_len"]:
        out += [
            Metric(P95_E2E.key(n), f"p95 e2e s @c{c} p{n}", "float", "lower", "serving"),
            Metric(P95_ITL.key(n), f"p95 ITL s @c{c} p{n}", "float", "lower", "serving"),
            Metric(SATURATION.key(n), f"saturation conc. p{n}", "int", "higher", "serving",
                   short=f"sat. p{n}"),
            Metric(SATURATION_ESTIMATE.key(n), f"estimate p{n}", "float", None, "serving"),
        ]  # fmt: skip
        if slo:
            out += [
                Metric(CAPACITY_RATE.key(n), f"req/s within SLO p{n} ({bounds})", "float",
                       "higher", "serving", short=f"req/s in SLO p{n}"),
                Metric(CAPACITY_CONC.key(n), f"clients within SLO p{n}", "int", "higher",
                       "serving"),
            ]  # fmt: skip
    return out


VERDICTS = "verdicts"


def verdicts_metric(reference: str) -> Metric:
    return Metric(VERDICTS, f"paired vs {reference}", "text", None, "quality",
                  short="paired verdicts")  # fmt: skip


def registry(
    tasks: list[str],
    measured: dict[str, VariantEvals],
    load_settings: dict | None,
    reference: str | None = None,
) -> list[Metric]:
    """The run's metrics, in table order; with a `reference`, each variant's paired verdicts
    against it (`reports.comparisons.summary`) lead the quality group."""
    out = [VARIANT, STEPS, SERVES_IN, *MEMORY]
    if reference is not None and len(measured) > 1:
        out.append(verdicts_metric(reference))
    for task in tasks:
        out += task_metrics(task, measured)
    div = next((e.divergence for e in measured.values() if e.divergence), None)
    for data in div.data if div else []:
        out += divergence_metrics(data, div.reference if div else "")
    if load_settings:
        out += serving_metrics(load_settings)
    return out
