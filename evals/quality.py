"""Quality of one variant with lm-eval: `simple_evaluate` over an `HFLM` that wraps the model
already in memory (an adapter variant is its base with the adapter applied through PEFT), its
loglikelihoods scored by `evals.continuation_lm` (the head only where lm-eval reads it).

Model: a task is either one of ours (the YAML files in `evals/tasks/`, documents from local files)
or one of lm-eval's standard tasks by its standard name (`evals.standard_tasks`: lm-eval's own
definition, its data from the local HF cache or the bundled copies). Only those files are indexed
(a `TaskManager` with lm-eval's task tree switched off); lm-eval runs with the hub switched off
(and, unless a task reads the user's HF cache, that cache in a temporary dir), so nothing can be
fetched. A task may be scored on a seeded random subset of `limit` documents (lm-eval's `samples`;
for a bundled copy, a split file of those documents alone, scored in the same order).
Accuracies come with their standard error. `max_length` is the window of the rolling perplexity
and the longest context scored; one value per recipe, so variants compare.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import tempfile
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals import standard_tasks
from evals.standard_tasks import Source, TaskSource

TASKS_DIR = Path(__file__).parent / "tasks"
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte", "acc", "acc_norm")


@dataclass(frozen=True)
class TaskRequest:
    """One task to score: all its documents, or a random subset of `limit` drawn with `seed`."""

    name: str
    limit: int | None = None
    seed: int = 0
    source: Source = "auto"


def available_tasks() -> list[str]:
    """Task names defined in `evals/tasks/*.yaml` (read without importing lm-eval)."""
    names = []
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        match = re.search(r"^task:\s*(\S+)", path.read_text(), re.MULTILINE)
        if match:
            names.append(match.group(1))
    return names


def check_task(request: TaskRequest) -> TaskSource | None:
    """Where a standard task's documents come from (None for ours); ValueError naming the fix
    for an unknown task or one without data here."""
    if standard_tasks.is_standard(request.name):
        return standard_tasks.resolve_source(request.name, request.source)
    if request.name in available_tasks():
        return None
    raise ValueError(
        f"unknown lm-eval task {request.name!r}; allowed: ours ({', '.join(available_tasks())}), "
        f"or lm-eval's {', '.join(standard_tasks.STANDARD)}, mmlu, mmlu_<subject>"
    )


@contextlib.contextmanager
def offline_hub(private_cache: bool = True) -> Iterator[None]:
    """HF hub and datasets offline for the block's duration; with `private_cache`, the HF cache
    is a fresh temporary dir too (nothing of the user's is read or written)."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME")
    saved = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="workbench-lm-eval-") as home:
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        if private_cache:
            os.environ["HF_HOME"] = home
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def task_manager(extra_dir: Path | None = None) -> Any:
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR), *([str(extra_dir)] if extra_dir else [])]
    return TaskManager(include_path=paths, include_defaults=False)


def _is_float(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def summarize(
    results: dict[str, Any], tasks: list[str], sources: dict[str, dict[str, str]] | None = None
) -> dict[str, dict[str, Any]]:
    """{task: {metric: value, metric_stderr: value, "samples": n[, "source", "split"]}} from
    lm-eval's results (a group's n is the sum over its subtasks)."""
    out: dict[str, dict[str, Any]] = {}
    for task in tasks:
        row = results["results"][task]
        metrics: dict[str, Any] = {}
        for metric in METRICS:
            if _is_float(row.get(f"{metric},none")):
                metrics[metric] = float(row[f"{metric},none"])
                stderr = row.get(f"{metric}_stderr,none")
                if _is_float(stderr):
                    metrics[f"{metric}_stderr"] = float(stderr)
        metrics["samples"] = float(_effective(results, task))
        metrics |= (sources or {}).get(task, {})
        out[task] = metrics
    return out


def _leaves(results: dict[str, Any], task: str) -> list[str]:
    if task in results.get("samples", {}):
        return [task]
    return [
        leaf for sub in results["group_subtasks"].get(task, []) for leaf in _leaves(results, sub)
    ]


def item_scores(results: dict[str, Any], task: str) -> dict[str, Any] | None:
    """The `ItemScores` JSON of `task` (a group: its subtasks' documents) from lm-eval's logged
    samples, ordered by id; None when samples were not logged."""
    if "samples" not in results:
        return None
    rows: list[tuple[str, dict[str, Any]]] = []
    for leaf in _leaves(results, task):
        rows += [(f"{leaf}/{s['doc_id']}", s) for s in results["samples"][leaf]]
    rows.sort(key=lambda r: r[0])
    out: dict[str, Any] = {"ids": [i for i, _ in rows]}
    for metric in ("acc", "acc_norm"):
        if rows and all(_is_float(s.get(metric)) for _, s in rows):
            out[metric] = [float(s[metric]) for _, s in rows]
    if rows and all(isinstance(s.get("bits_per_byte"), list | tuple) for _, s in rows):
        out["loglikelihood"] = [float(s["bits_per_byte"][0]) for _, s in rows]
        out["bytes"] = [int(s["bits_per_byte"][1]) for _, s in rows]
    return out


def _effective(results: dict[str, Any], task: str) -> int:
    if task in results["n-samples"]:
        return int(results["n-samples"][task]["effective"])
    return sum(_effective(results, t) for t in results["group_subtasks"][task])


def evaluate_model(
    model: Any,
    tokenizer: Any,
    tasks: list[TaskRequest],
    max_length: int,
    batch_size: int = 16,
    limit: int | None = None,
    log_samples: bool = True,
) -> dict[str, Any]:
    """lm-eval's full results dict for `model` (a transformers or PEFT model) on `tasks`, with
    every document's scores (`samples`) unless `log_samples` is off."""
    from evals.continuation_lm import ContinuationLM

    # the model and tokenizer are objects already: only the tasks need the hub switched off
    lm = ContinuationLM(
        pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length
    )
    return run_tasks(lm, None, tasks, limit, log_samples)


def _leaf_sources(request: TaskRequest) -> list[TaskSource]:
    """Where each task a standard task runs reads its documents; [] for ours. ValueError for an
    unknown task or one without data here."""
    if standard_tasks.is_standard(request.name):
        return standard_tasks.leaf_sources(request.name, request.source)
    check_task(request)
    return []


def _leaf_doc_counts(names: list[str], manager: Any) -> dict[str, int]:
    """{leaf task: documents in its scored split}, from the task objects lm-eval builds."""
    tasks = manager.load(names)["tasks"]
    return {name: len(task.eval_docs) for name, task in tasks.items()}


def _draw(request: TaskRequest, total: int) -> list[int] | None:
    """`limit` sorted document indices of `total` drawn with the task's seed; None (all of
    them) when there are no more."""
    if request.limit is None or request.limit >= total:
        return None
    return sorted(random.Random(request.seed).sample(range(total), request.limit))


def _subsets(
    tasks: list[TaskRequest], manager: Any, written: AbstractSet[str] = frozenset()
) -> dict[str, list[int]]:
    """lm-eval's `samples` for each leaf of a task with a limit that is not among `written`
    (bundled leaves whose subset is already their split: `_bundled_subsets`)."""
    out: dict[str, list[int]] = {}
    for t in tasks:
        if t.limit is None or set(standard_tasks.leaf_tasks(t.name)) <= written:
            continue
        for leaf, total in _leaf_doc_counts([t.name], manager).items():
            rows = _draw(t, total)
            if rows is not None and leaf not in written:
                out[leaf] = rows
    return out


def _bundled_subsets(
    request: TaskRequest, leaves: list[TaskSource], first: int | None = None
) -> dict[str, list[int] | None]:
    """{leaf: its subset's rows, or None for all} for a standard task read from bundled copies
    (counted from their files, no task built): the task's seeded draw, or with `first` the
    split's first rows (what lm-eval's `limit` scores); {} for any other task."""
    limited = request.limit is not None or first is not None
    if not limited or not leaves or any(s.source != "bundled" for s in leaves):
        return {}
    out: dict[str, list[int] | None] = {}
    for s in leaves:
        total = standard_tasks.bundled_documents(s)
        if first is None:
            out[s.task] = _draw(request, total)
        else:
            out[s.task] = None if first >= total else list(range(first))
    return out


def run_tasks(
    model: Any,
    model_args: dict[str, Any] | None,
    tasks: list[TaskRequest],
    limit: int | None,
    log_samples: bool,
) -> dict[str, Any]:
    """`simple_evaluate` on `tasks`, hub off; `model` is an lm-eval model object or a registered
    model name with its `model_args`. `limit` (the first documents of every task) overrides the
    tasks' own subsets. The results carry `workbench_sources`: each standard task's source and
    split."""
    from lm_eval import simple_evaluate

    leaves = {t.name: _leaf_sources(t) for t in tasks}
    hub = any(s.source == "hub" for found in leaves.values() for s in found)
    with tempfile.TemporaryDirectory(prefix="workbench-tasks-") as tmp, offline_hub(not hub):
        records = []
        bundled: dict[str, list[int] | None] = {}  # leaf: its subset's rows (None: all)
        for t in tasks:
            found = leaves[t.name]
            subsets = _bundled_subsets(t, found, limit)
            for where in found:
                standard_tasks.write_task_yaml(where, Path(tmp), subsets.get(where.task))
            bundled |= subsets
            records += found
            if standard_tasks.leaf_tasks(t.name) != [t.name]:  # a group (mmlu)
                standard_tasks.write_group_yaml(t.name, Path(tmp))
                records.append(standard_tasks.group_source(t.name, found))
        manager = task_manager(Path(tmp))
        samples = _subsets(tasks, manager, bundled.keys()) if limit is None else {}
        results = simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[t.name for t in tasks],
            task_manager=manager,
            limit=limit,
            samples=samples or None,
            log_samples=log_samples,
            bootstrap_iters=1000,  # accuracies' stderr is analytic; nothing here bootstraps
            verbosity="ERROR",
        )
    for leaf, rows in bundled.items():  # the split's own indices, as `samples` logs them
        if rows is None:
            continue
        for sample in results.get("samples", {}).get(leaf, []):
            sample["doc_id"] = rows[sample["doc_id"]]
    results["workbench_sources"] = standard_tasks.split_record(records)
    return results
