"""The build and mirror tasks of a run's graph: one step applied to its parent artifact, or a
finished artifact mirrored under another variant's name; each committed whole.

Model: a task first looks for its artifact already committed (its manifest records the node's
hash and its files are intact: an earlier attempt, or an earlier run, made it) and hands that on.
Otherwise it removes the leftovers of earlier attempts at its own target (NOTE: safe because one
driver holds the work dir and hands each node to one attempt at a time: a leftover belongs to a
dead attempt), builds into a temporary dir, writes the manifest last, and renames the dir into
place (`workbench.storage`). Under `accelerate launch` / `torchrun` every process runs every step
and only the main one writes (`workbench.distributed`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from catalog.data import NAMED
from compress import STEPS, Artifact, StepContext
from compress.artifact import (
    MANIFEST,
    artifact_from_manifest,
    atomic_dir,
    count_parameters,
    dir_bytes,
    file_hashes,
    link_or_copy_tree,
    remove_stale_tmp,
    verify_files,
)
from compress.manifest import ArtifactEval, BaseRecord, Manifest, ParentRef, RecipeRef, StepRecord
from workbench.base_model import BaseRef, base_artifact, base_fingerprint
from workbench.distributed import barrier, is_main, scratch_dir
from workbench.measure import PeakMemory, package_versions
from workbench.model_shape import parameter_count
from workbench.recipe import Recipe
from workbench.storage import commit_gate
from workbench.task_graph import ArtifactRef, Node, StepCall, chain

Evaluate = Callable[[Artifact], ArtifactEval]
"""Measures a finished variant (memory, load time, perplexities) for its manifest."""


def manifest_digest(path: Path) -> str:
    return hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()


def reusable(
    path: Path,
    expected: str,
    problems: list[str],
    verify: Callable[[Path, object], str | None] = verify_files,
) -> Manifest | None:
    """The manifest of the artifact at `path` when it has the expected hash and its files are
    intact (`verify`); when the hash is right but the files are not, the reason is appended to
    `problems`."""
    manifest = Manifest.read(path)
    if manifest is None or manifest.hash != expected:
        return None
    problem = verify(path, manifest.files)
    if problem is not None:
        problems.append(f"{path}: {problem}")
        return None
    return manifest


def committed_ref(path: Path, expected: str, problems: list[str]) -> ArtifactRef | None:
    """A reference to the intact artifact of hash `expected` at `path`, if it is committed."""
    if reusable(path, expected, problems) is None:
        return None
    return ArtifactRef(expected, str(path), manifest_digest(path), "reused")


class Builder:
    """Runs a recipe's build and mirror nodes in one work dir."""

    def __init__(
        self,
        recipe: Recipe,
        base: BaseRef,
        work_dir: Path,
        recipe_hash: str,
        force: bool = False,
        evaluate: Evaluate | None = None,
        keep_checkpoints: int = 1,
    ) -> None:
        self.recipe, self.base, self.work_dir, self.force = recipe, base, work_dir, force
        self.recipe_hash, self.evaluate, self.keep_checkpoints = (
            recipe_hash,
            evaluate,
            keep_checkpoints,
        )

    @functools.cached_property
    def base_hash(self) -> str:
        return base_fingerprint(self.base)

    def build(self, node: Node, parent: ArtifactRef | None) -> ArtifactRef:
        """Commit node's artifact (step `node.step` of `node.variant` applied to `parent`, the
        base when None) and reference it."""
        assert node.out is not None and node.variant is not None and node.step is not None
        out = self.work_dir / node.out
        if not self.force and (found := committed_ref(out, node.key, [])) is not None:
            return found  # an earlier attempt committed it
        variant = next(v for v in self.recipe.variants if v.name == node.variant)
        calls = chain(variant, self.base_hash, self.recipe.seed)[: node.step + 1]
        if parent is None:
            artifact = base_artifact(self.base)
            parent_ref = ParentRef(path=str(artifact.path), hash=self.base_hash)
        else:
            artifact = artifact_from_manifest(Path(parent.path))
            parent_ref = ParentRef(path=parent.path, hash=parent.hash)
        if is_main():
            remove_stale_tmp(out.parent, only=out)
        self._apply(node.variant, calls, artifact, parent_ref, out)
        return ArtifactRef(node.key, str(out), manifest_digest(out), "built")

    def mirror(self, node: Node, source: ArtifactRef) -> ArtifactRef:
        """`source`'s artifact mirrored into `variants/<node.variant>` (hard links where
        possible), its manifest naming that variant; the rest is the source's own record."""
        assert node.out is not None and node.variant is not None
        final = self.work_dir / node.out
        if is_main():  # the others read what it wrote, as after a build
            remove_stale_tmp(final.parent, only=final)
            found = Manifest.read(Path(source.path))
            assert found is not None, f"{source.path}: committed by its build task"
            with atomic_dir(final) as tmp:
                link_or_copy_tree(Path(source.path), tmp)
                found.model_copy(update={"variant": node.variant}).write(tmp)
        barrier()
        return ArtifactRef(source.hash, str(final), manifest_digest(final), "built")

    def _apply(
        self,
        variant: str,
        calls: list[StepCall],
        artifact: Artifact,
        parent: ParentRef,
        out: Path,
    ) -> None:
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
                step.apply(artifact, dataclasses.replace(ctx, out_dir=tmp))
            barrier()
            return
        with atomic_dir(out) as tmp:
            started = time.perf_counter()
            with PeakMemory() as peak:
                made = step.apply(artifact, dataclasses.replace(ctx, out_dir=tmp))
            wall_seconds = round(time.perf_counter() - started, 3)
            made = dataclasses.replace(made, path=tmp)
            manifest = self._manifest(variant, calls, made, parent, wall_seconds, peak)
            commit_gate(call.hash)
            manifest.write(tmp)  # last: the commit marker
        shutil.rmtree(checkpoints, ignore_errors=True)
        barrier()

    def _manifest(
        self,
        variant: str,
        calls: list[StepCall],
        made: Artifact,
        parent: ParentRef,
        wall_seconds: float,
        peak: PeakMemory,
    ) -> Manifest:
        """What the finished artifact (still in its temporary dir `made.path`) records."""
        return Manifest(
            variant=variant,
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
