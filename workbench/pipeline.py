"""Run a recipe: for each variant, apply its steps in order and keep every artifact on disk.

Model: a step's output is named by a hash chain, `h_i = sha(h_{i-1}, step name, params, seed)`,
starting from the base's fingerprint. A variant's final artifact lives in `variants/<name>/`; the
outputs of earlier steps live in `artifacts/<h_i>/`, shared by variants with a common prefix.
An artifact whose manifest records the expected hash, and whose files still have the content
hashes the manifest records, is reused; any other (changed, truncated, missing files) is
rebuilt, and the result says why. Variants with the same steps (say, one served with an int8 KV
cache beside the plain one: they differ only in `serve:`) build once: the later one mirrors the
other's final artifact (hard links) under its own name. Every
artifact is written to a temporary dir and renamed into place when complete, under a lock on the
work dir, so an interrupted run leaves only temporary dirs, which the next run deletes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from catalog.data import NAMED
from compress import STEPS, Artifact, StepContext, StepParams
from compress.artifact import (
    artifact_from_manifest,
    atomic_dir,
    count_parameters,
    dir_bytes,
    file_hashes,
    link_or_copy_tree,
    remove_stale_tmp,
    verify_files,
)
from compress.locking import file_lock
from compress.manifest import (
    ArtifactEval,
    BaseRecord,
    Manifest,
    ParentRef,
    RecipeRef,
    StepRecord,
)
from compress.registry import StepError
from evals.variant import VariantResult
from workbench.base_model import BaseRef, base_artifact, base_fingerprint
from workbench.distributed import barrier, is_main, scratch_dir
from workbench.measure import PeakMemory, package_versions
from workbench.recipe import Recipe, Variant


@dataclass(frozen=True)
class _StepCall:
    name: str
    params: StepParams
    hash: str


def _sha(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


def recipe_hash(recipe: Recipe) -> str:
    return _sha(json.dumps(recipe.model_dump(mode="json"), sort_keys=True))


def _chain(variant: Variant, base_hash: str, seed: int) -> list[_StepCall]:
    calls, parent = [], base_hash
    for name, params in variant.step_calls():
        parent = _sha(parent, name, params.model_dump_json(), str(seed))
        calls.append(_StepCall(name, params, parent))
    return calls


class PipelineError(Exception):
    """Steps that cannot run as written; raised before anything is built."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


Evaluate = Callable[[Artifact], ArtifactEval]
"""Measures a finished variant (memory, load time, perplexities) for its manifest."""


class Pipeline:
    """One recipe run in one work dir; `run()` returns what it built and what it reused."""

    def __init__(
        self,
        recipe: Recipe,
        base: BaseRef,
        work_dir: Path,
        force: bool = False,
        evaluate: Evaluate | None = None,
        keep_checkpoints: int = 1,
    ) -> None:
        self.recipe, self.base, self.work_dir, self.force = recipe, base, work_dir, force
        self.keep_checkpoints = keep_checkpoints
        self.recipe_hash = recipe_hash(recipe)
        self.evaluate = evaluate
        self._locked = False
        self._intact: dict[Path, str] = {}
        """Final artifacts this run wrote or verified, with their hashes: under the work dir's
        lock nothing else changes them, so a twin among them is mirrored without a re-read."""

    def check(
        self,
        variants: list[Variant],
        module_names: list[str] | None,
        position_limit: int | None = None,
    ) -> None:
        """Each step must accept what the step before it makes, and its params must fit the
        model (e.g. targets that exist; not checked when `module_names` is None); no training
        window or eval length may pass the base's `position_limit`; every problem is reported
        at once."""
        problems = self.recipe.evals.length_problems(position_limit)
        for v_index, variant in enumerate(self.recipe.variants):
            if variant not in variants:
                continue
            state = Artifact(Path(), "model")
            for s_index, (name, params) in enumerate(variant.step_calls()):
                where = f"variants[{v_index}] ({variant.name}).steps[{s_index}].{name}"
                step = STEPS[name](params)
                if state.kind not in step.accepts:
                    problems.append(
                        f"{where}: cannot follow a step that makes a {state.kind} "
                        f"(it takes a {' or '.join(step.accepts)}); reorder the steps"
                    )
                    break
                seq_len = getattr(params, "seq_len", None)
                if position_limit is not None and seq_len is not None and seq_len > position_limit:
                    problems.append(
                        f"{where}.seq_len: {seq_len} is past the base's position limit "
                        f"({position_limit} positions); use {position_limit} or less"
                    )
                try:
                    step.check(state, module_names)
                except StepError as e:
                    problems.append(f"{where}: {e}")
                state = step.planned_output(state)
        if problems:
            raise PipelineError(problems)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the work dir's lock (on the main process), leftovers of killed builds removed:
        `run` takes it, and a caller that also measures what was built holds it across both, so
        no concurrent run can swap a variant under a measurement. Re-entrant per pipeline."""
        if self._locked:
            yield
            return
        lock = file_lock(self.work_dir / ".lock") if is_main() else contextlib.nullcontext()
        with lock:
            self._locked = True
            try:
                if is_main():
                    for sub in ("variants", "artifacts"):
                        remove_stale_tmp(self.work_dir / sub)
                barrier()
                yield
            finally:
                self._locked = False

    def run(
        self,
        only: list[str] | None = None,
        on_result: Callable[[VariantResult], None] | None = None,
    ) -> list[VariantResult]:
        variants = [v for v in self.recipe.variants if only is None or v.name in only]
        base = base_artifact(self.base)
        self.check(variants, module_names(base.path), position_limit(base.path))
        results = []
        with self.locked():
            base_hash = base_fingerprint(self.base)
            for variant in variants:
                results.append(self._run_variant(variant, base, base_hash))
                if on_result and is_main():
                    on_result(results[-1])
        return results

    def _run_variant(self, variant: Variant, base: Artifact, base_hash: str) -> VariantResult:
        calls = _chain(variant, base_hash, self.recipe.seed)
        final = self.work_dir / "variants" / variant.name
        barrier()  # every process decides on the same files
        problems: list[str] = []
        if not self.force and (reused := _reusable(final, calls[-1].hash, problems)):
            self._intact[final] = calls[-1].hash
            return VariantResult(variant.name, final, "reused", reused, serve=variant.serve)
        if not self.force and (twin := self._twin(variant.name, calls[-1].hash)):
            if is_main():  # the others read what it wrote, as after a build
                _mirror(twin, final, variant.name)
            barrier()
            mirrored = Manifest.read(final)
            assert mirrored is not None, f"{final}: mirrored by this run"
            self._intact[final] = calls[-1].hash
            return VariantResult(variant.name, final, "reused", mirrored, serve=variant.serve)
        artifact, parent = base, ParentRef(path=str(base.path), hash=base_hash)
        for i, call in enumerate(calls):
            out = final if i == len(calls) - 1 else self.work_dir / "artifacts" / call.hash
            if out != final and not self.force and _reusable(out, call.hash, problems):
                artifact = artifact_from_manifest(out)
            else:
                artifact = self._apply(variant, calls[: i + 1], artifact, parent, out)
            parent = ParentRef(path=str(out), hash=call.hash)
        manifest = Manifest.read(final)
        assert manifest is not None, f"{final}: written by this run"
        self._intact[final] = calls[-1].hash
        because = "; ".join(problems) or None
        return VariantResult(variant.name, final, "built", manifest, because, variant.serve)

    def _twin(self, name: str, expected: str) -> Path | None:
        """Another variant's intact final artifact with the hash `expected`, if one is built
        (one this run wrote or verified first: its files are not read again)."""
        for other, hash_ in self._intact.items():
            if hash_ == expected and other.name != name:
                return other
        for other in sorted((self.work_dir / "variants").glob("*")):
            skip = other.name == name or other.name.startswith(".")  # itself, or unfinished
            if not skip and _reusable(other, expected, []) is not None:
                return other
        return None

    def _apply(
        self,
        variant: Variant,
        calls: list[_StepCall],
        artifact: Artifact,
        parent: ParentRef,
        out: Path,
    ) -> Artifact:
        call = calls[-1]
        step = STEPS[call.name](call.params)
        checkpoints = self.work_dir / "checkpoints" / call.hash
        ctx = StepContext(
            Path(),
            self.recipe.seed,
            _device(self.recipe.device),
            checkpoints,
            self.keep_checkpoints,
            NAMED,
        )
        if not is_main():  # every process trains; only the main one writes the artifact
            with scratch_dir() as tmp:
                made = step.apply(artifact, dataclasses.replace(ctx, out_dir=tmp))
            barrier()
            return dataclasses.replace(made, path=out)
        with atomic_dir(out) as tmp:
            started = time.perf_counter()
            with PeakMemory() as peak:
                made = step.apply(artifact, dataclasses.replace(ctx, out_dir=tmp))
            wall_seconds = round(time.perf_counter() - started, 3)
            made = dataclasses.replace(made, path=tmp)
            self._manifest(variant, calls, made, parent, wall_seconds, peak).write(tmp)
        shutil.rmtree(checkpoints, ignore_errors=True)
        barrier()
        return dataclasses.replace(made, path=out)

    def _manifest(
        self,
        variant: Variant,
        calls: list[_StepCall],
        made: Artifact,
        parent: ParentRef,
        wall_seconds: float,
        peak: PeakMemory,
    ) -> Manifest:
        """What the finished artifact (still in its temporary dir `made.path`) records."""
        return Manifest(
            variant=variant.name,
            kind=made.kind,
            quantization=made.quantization,
            hash=calls[-1].hash,
            recipe=RecipeRef(name=self.recipe.name, hash=self.recipe_hash),
            base=BaseRecord(kind=self.base.kind, name=self.base.name),
            steps=[
                StepRecord(name=c.name, params=c.params.model_dump(mode="json"), hash=c.hash)
                for c in calls
            ],
            parent=parent,
            parameters=parameter_count(made.kind, made.path),
            stored_tensor_elements=count_parameters(made.path),
            bytes_on_disk=dir_bytes(made.path),
            wall_seconds=wall_seconds,
            peak_memory_bytes=peak.bytes,
            peak_cuda_memory_bytes=peak.cuda_bytes,
            packages=package_versions(),
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            info=made.info,
            files=file_hashes(made.path),
            eval=self.evaluate(made) if self.evaluate else None,
        )


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _meta_model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.quantization_config = None  # the architecture only
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def position_limit(model_dir: Path) -> int | None:
    """The most positions the model in `model_dir` encodes, from its config (None: unstated)."""
    from transformers import AutoConfig

    from serve.model.model_runner import config_position_limit

    return config_position_limit(AutoConfig.from_pretrained(model_dir))


def module_names(model_dir: Path) -> list[str]:
    """Module names of the model in `model_dir`, from its config alone (no weights loaded)."""
    return [n for n, _ in _meta_model(model_dir).named_modules()]


def parameter_count(kind: str, path: Path) -> int:
    """A model's parameters as its architecture defines them (a quantized weight counts as many
    parameters as the float one it replaces); an adapter's stored tensor elements."""
    if kind == "adapter":
        return count_parameters(path)
    return sum(p.numel() for p in _meta_model(path).parameters())


def _mirror(twin: Path, final: Path, name: str) -> None:
    """`twin`'s artifact mirrored into `final` (hard links where possible), its manifest naming
    the variant `name`; everything else it records (how and when it was built) is the twin's."""
    found = Manifest.read(twin)
    assert found is not None, f"{twin}: checked by _twin"
    with atomic_dir(final) as tmp:
        link_or_copy_tree(twin, tmp)
        found.model_copy(update={"variant": name}).write(tmp)


def _reusable(path: Path, expected: str, problems: list[str]) -> Manifest | None:
    """The manifest of the artifact at `path` when it has the expected hash and its files are
    intact; when the hash is right but the files are not, the reason is appended to `problems`."""
    manifest = Manifest.read(path)
    if manifest is None or manifest.hash != expected:
        return None
    problem = verify_files(path, manifest.files)
    if problem is not None:
        problems.append(f"{path}: {problem}")
        return None
    return manifest
