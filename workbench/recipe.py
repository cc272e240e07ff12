"""The recipe schema: one base model, several variants (each a flat list of steps), evals, report.

Every model forbids unknown keys. A step is a mapping with exactly one key, the step's registered
name, whose value holds that step's params (validated by the step's own `Params` model).
`load_recipe` turns any problem into a `RecipeError` whose lines each name the file, the field
path, what was found and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from catalog.data import NAMED
from compress import STEPS, StepParams
from evals.settings import Evals, ServeSettings, Slug
from reports.gates import Gates, declared_problems
from workbench.base_model import BaseRef, resolve_base
from workbench.recipe_errors import RecipeError, format_validation_error
from workbench.resources import EvalResources, Resources


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


class ReportSettings(_Strict):
    title: str | None = None
    output_dir: str | None = None
    """Where the report goes; `reports/<recipe name>` when absent."""


class Variant(_Strict):
    name: Slug
    steps: list[StepSpec] = []  # type: ignore[valid-type]
    serve: ServeSettings = ServeSettings()
    """How the variant is served and measured beyond its weights (e.g. `{kv_cache_dtype: int8}`);
    a variant with the same steps as another builds nothing new."""
    resources: Resources = Resources()
    """What each of its build steps asks of a cluster (`workbench run --executor ray`); derived
    from the base's size and the step's kind where left out. Changes no hash."""

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
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """Seeds every step's and eval's random draws (torch, lm-eval: at most 2^31 - 1)."""
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where steps run: auto (cuda when available), cpu, cuda or cuda:N."""
    variants: list[Variant] = Field(min_length=1)
    evals: Evals = Evals()
    report: ReportSettings = ReportSettings()
    gates: Gates = {}
    """Quality gates, `{kind: {task or data set: threshold}}` (`reports.gates.GATE_KINDS`):
    `recovery: {hellaswag: 0.95}`; a variant that fails one is a problem of the report, and
    `workbench run` exits `reports.gates.GATE_FAILED` after writing it."""
    resources: EvalResources = EvalResources()
    """What each kind of measurement asks of a cluster; derived where left out."""
    storage: str | None = None
    """The work dir every node of a cluster mounts (`--storage` overrides it; default
    `runs/<name>`): a path, relative to where `workbench run` starts, or an fsspec URL
    (`s3://bucket/run`: `workbench.remote_store`)."""

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

    @field_validator("gates")
    @classmethod
    def _gates_measured(cls, gates: Gates, info: ValidationInfo) -> Gates:
        evals = info.data.get("evals")  # absent: evals is invalid, and reported as such
        problems = declared_problems(gates, evals) if evals is not None else []
        if problems:
            raise ValueError("; ".join(problems))
        return gates

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
    context = {"recipe_dir": path.parent, "data": NAMED}  # the data sets recipes may name
    try:
        recipe = Recipe.model_validate(data, context=context)
    except ValidationError as e:
        raise RecipeError(path, format_validation_error(e, Recipe)) from None
    return recipe, resolve_base(recipe.base, path.parent)
