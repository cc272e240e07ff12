"""Quality of one variant with lm-eval: `simple_evaluate` over an `HFLM` that wraps the model
already in memory (an adapter variant is its base with the adapter applied through PEFT).

Model: the tasks are the YAML files in `evals/tasks/` (a `TaskManager` with lm-eval's own tasks
switched off), whose documents come from local files; lm-eval runs with the hub switched off and
its HF cache in a temporary dir, so nothing can be fetched. `max_length` is the window of the
rolling perplexity and the longest context scored; one value per recipe, so variants compare.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).parent / "tasks"
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte", "acc", "acc_norm")


def available_tasks() -> list[str]:
    """Task names defined in `evals/tasks/*.yaml` (read without importing lm-eval)."""
    names = []
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        match = re.search(r"^task:\s*(\S+)", path.read_text(), re.MULTILINE)
        if match:
            names.append(match.group(1))
    return names


@contextlib.contextmanager
def offline_hub() -> Iterator[None]:
    """HF hub and datasets offline, HF cache in a fresh temporary dir, for the block's duration."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME")
    saved = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="workbench-lm-eval-") as home:
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=home)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def task_manager() -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def summarize(results: dict[str, Any], tasks: list[str]) -> dict[str, dict[str, float]]:
    """{task: {metric: value, metric_stderr: value, "samples": n}} from lm-eval's results."""
    out: dict[str, dict[str, float]] = {}
    for task in tasks:
        row = results["results"][task]
        metrics: dict[str, float] = {}
        for metric in METRICS:
            if f"{metric},none" in row:
                metrics[metric] = float(row[f"{metric},none"])
                stderr = row.get(f"{metric}_stderr,none")
                if isinstance(stderr, int | float):
                    metrics[f"{metric}_stderr"] = float(stderr)
        metrics["samples"] = float(results["n-samples"][task]["effective"])
        out[task] = metrics
    return out


def evaluate_model(
    model: Any,
    tokenizer: Any,
    tasks: list[str],
    max_length: int,
    batch_size: int = 16,
    limit: int | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's full results dict for `model` (a transformers or PEFT model) on `tasks`."""
    from lm_eval.models.huggingface import HFLM

    # the model and tokenizer are objects already: only the tasks need the hub switched off
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    return run_tasks(lm, None, tasks, limit, log_samples)


def run_tasks(
    model: Any,
    model_args: dict[str, Any] | None,
    tasks: list[str],
    limit: int | None,
    log_samples: bool,
) -> dict[str, Any]:
    """`simple_evaluate` on the bundled tasks, hub off; `model` is an lm-eval model object or
    a registered model name with its `model_args`. Stderr is skipped (`bootstrap_iters=0`)."""
    from lm_eval import simple_evaluate

    with offline_hub():
        return simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=tasks,
            task_manager=task_manager(),
            limit=limit,
            log_samples=log_samples,
            bootstrap_iters=0,
            verbosity="ERROR",
        )
