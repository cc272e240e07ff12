"""The recipe schema: one base model, several variants (each a flat list of steps), evals, report.

Every model forbids unknown keys. A step is a mapping with exactly one key, the step's registered
name, whose value holds that step's params (validated by the step's own `Params` model).
`load_recipe` turns any problem into a `RecipeError` whose lines each name the file, the field
path, what was found and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PositiveInt,
    Tag,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from catalog import data as demo_data
from compress import STEPS, StepParams
from workbench.base_model import BaseRef, resolve_base
from workbench.recipe_errors import RecipeError, format_validation_error

demo_data.register()  # the named data sets (corpus, shift) recipes may use

Slug = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _step_name(value: Any) -> str | None:
    if isinstance(value, dict) and len(value) == 1:
        return next(iter(value))
    if isinstance(value, BaseModel):
        return next(iter(type(value).model_fields))
    return None


def _step_union() -> Any:
    """Tagged union of one single-key model per registered step: {name: Params}."""
    members = [
        Annotated[
            create_model(  # type: ignore[call-overload]  # field definitions given as kwargs
                f"{name}_step", __base__=_Strict, **{name: (cls.Params, ...)}
            ),
            Tag(name),
        ]
        for name, cls in STEPS.items()
    ]
    return Annotated[
        Union[tuple(members)],  # noqa: UP007 (a runtime-built union)
        Discriminator(_step_name, custom_error_type="step_shape", custom_error_message="bad step"),
    ]


StepSpec = _step_union()


class LoadEval(_Strict):
    concurrency: list[PositiveInt] = Field(default=[1, 2, 4, 8, 16, 32, 64, 128], min_length=1)
    """Concurrent clients to ramp through."""
    prompt_len: list[PositiveInt] = Field(default=[64, 256, 1024], min_length=1)
    """Prompt lengths in tokens."""
    max_tokens: PositiveInt = 64
    """Output tokens per request."""
    requests_per_client: PositiveInt = 2
    """Requests each client sends back to back: a point has max(this x concurrency, 8)."""
    requests_per_point: PositiveInt | None = None
    """A fixed number of requests per point instead."""
    kv_cache_memory: str | None = Field(default=None, pattern=r"^\d+(\.\d+)?\s*([KMG]i?B)?$")
    """The server's KV cache budget, e.g. 8MiB (default: the server's own)."""
    max_num_seqs: PositiveInt = 256
    """The server's running-request cap: above the ramp's top, so the KV cache is the limit."""


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
    data: list[str] = Field(default=["corpus"], min_length=1)
    """Named data sets whose validation split is scored (corpus, shakespeare, ...)."""
    windows: PositiveInt = 32
    """Windows scored per data set."""
    seq_len: PositiveInt = 128
    """Tokens per window."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Both models' float dtype (bfloat16 rounding alone moves KL and agreement: keep float32
    when comparing quantizations)."""

    @field_validator("data")
    @classmethod
    def _known_data(cls, names: list[str]) -> list[str]:
        from compress.data import NAMED_DATA

        unknown = [n for n in names if n not in NAMED_DATA]
        if unknown:
            raise ValueError(f"unknown data set(s) {unknown}; allowed: {', '.join(NAMED_DATA)}")
        return names


def _as_spec(task: str | QualityTask) -> QualityTask:
    """A quality task written as a bare name, or in full."""
    return QualityTask(task=task) if isinstance(task, str) else task


class Evals(_Strict):
    quality: list[Slug | QualityTask] = []
    """lm-eval tasks: ours from `evals/tasks/`, or lm-eval's standard ones by name (hellaswag,
    piqa, arc_easy, mmlu_<subject>, ...); a name, or {task, limit, seed, source}."""
    max_length: PositiveInt | None = None
    """Longest context lm-eval scores (the rolling-perplexity window); default: the base's
    `max_position_embeddings`, at most 2048."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The float dtype lm-eval scores in (bfloat16 halves its time on CPUs with avx512_bf16)."""
    batch_size: PositiveInt = 16
    """lm-eval's batch size."""
    divergence: DivergenceEval | None = None
    """KL divergence and top-1 agreement of each variant against a reference variant."""
    chat_prompts: list[str] = []
    """User messages every variant answers greedily through its server (shown side by side)."""
    chat_max_tokens: PositiveInt = 48
    server_check_docs: int = Field(default=8, ge=0)
    """Documents per task scored both in-process and through the server (0: no check)."""
    load: LoadEval | None = None
    """Load benchmark settings; no load benchmark when absent."""

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
        return [tasks, self.dtype, self.batch_size]

    def task_names(self) -> list[str]:
        return [_as_spec(t).task for t in self.quality]


class ReportSettings(_Strict):
    title: str | None = None
    output_dir: str | None = None
    """Where the report goes; `reports/<recipe name>` when absent."""


class Variant(_Strict):
    name: Slug
    steps: list[StepSpec] = []  # type: ignore[valid-type]

    def step_calls(self) -> list[tuple[str, StepParams]]:
        """(step name, params) in order; `steps: []` is the identity step."""
        calls = []
        for step in self.steps:
            name = _step_name(step)
            assert name is not None  # validated: every step is a one-key model
            calls.append((name, getattr(step, name)))
        return calls or [("identity", STEPS["identity"].Params())]


class Recipe(_Strict):
    name: Slug
    base: str
    """`demo`, `demo-tiny`, a local HF model dir (relative to the recipe file) or a hub id."""
    seed: int = 0
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where steps run: auto (cuda when available), cpu, cuda or cuda:N."""
    variants: list[Variant] = Field(min_length=1)
    evals: Evals = Evals()
    report: ReportSettings = ReportSettings()

    @field_validator("base")
    @classmethod
    def _base_exists(cls, value: str, info: ValidationInfo) -> str:
        resolve_base(value, (info.context or {}).get("recipe_dir", Path.cwd()))
        return value

    @model_validator(mode="after")
    def _divergence_reference_exists(self) -> Recipe:
        div = self.evals.divergence
        names = [v.name for v in self.variants]
        if div is not None and div.reference not in names:
            raise ValueError(
                f"evals.divergence.reference: found {div.reference!r}; allowed: a variant "
                f"name ({', '.join(names)})"
            )
        return self

    @field_validator("variants")
    @classmethod
    def _unique_names(cls, variants: list[Variant]) -> list[Variant]:
        seen: dict[str, int] = {}
        for i, v in enumerate(variants):
            if v.name in seen:
                raise ValueError(
                    f"duplicate variant name {v.name!r} (variants[{seen[v.name]}] and "
                    f"variants[{i}]); each variant needs its own name"
                )
            seen[v.name] = i
        return variants


def load_recipe(path: Path | str) -> tuple[Recipe, BaseRef]:
    """Parse and validate a recipe file; raise `RecipeError` naming every problem."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise RecipeError(
            path, ["no such file; pass the path of a recipe YAML, e.g. recipes/demo.yaml"]
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(path, [f"not valid YAML{where}: {problem}"]) from None
    if not isinstance(data, dict):
        keys = ", ".join(Recipe.model_fields)
        raise RecipeError(
            path,
            [f"found {type(data).__name__}; a recipe is a mapping with keys {keys}"],
        )
    context = {"recipe_dir": path.parent}
    try:
        recipe = Recipe.model_validate(data, context=context)
    except ValidationError as e:
        raise RecipeError(path, format_validation_error(e, Recipe)) from None
    return recipe, resolve_base(recipe.base, path.parent)
