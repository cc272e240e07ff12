"""The engine's C kernels built ahead of their first use (`serve.model.kernel_builds`)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from serve.model import bnb_linear, cpu_attention, fused_ops, greedy, native
from serve.model.kernel_builds import engine_kernels, prebuild_engine_kernels

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler `cc` here")


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory for kernel sources; the libraries built from them go to a cache of its own."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


@needs_cc
def test_a_loader_meeting_a_build_in_flight_waits_for_it_instead_of_building_again(
    sources: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = sources / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    compiled: list[Path] = []
    compile_for_real = native._compile

    def slow_compile(source: Path, compiler: str, flags: list[str], target: Path) -> None:
        compiled.append(source)
        time.sleep(0.5)  # the loader below arrives while this build is in flight
        compile_for_real(source, compiler, flags, target)

    monkeypatch.setattr(native, "_compile", slow_compile)
    threads = native.build_in_background([(source, ["-O2"])])
    lib, why_not = native.build_library(source, ["-O2"])
    for thread in threads:
        thread.join()
    assert why_not == "" and lib is not None and lib.answer() == 42
    assert compiled == [source]


@needs_cc
def test_a_failing_background_build_is_left_for_the_loader_to_report(sources: Path) -> None:
    source = sources / "broken.c"
    source.write_text("int broken(void) { return }\n")
    for thread in native.build_in_background([(source, ["-O2"])]):
        thread.join()
    lib, why_not = native.build_library(source, ["-O2"])
    assert lib is None and "broken.c" in why_not and "error" in why_not


def test_every_kernel_source_is_built_ahead() -> None:
    assert {source for source, _ in engine_kernels()} == set(native.KERNELS.glob("*.c"))


@needs_cc
def test_the_loaders_find_the_libraries_built_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    for thread in prebuild_engine_kernels():
        thread.join()

    def no_compiling(source: Path, *_: object) -> None:
        raise AssertionError(f"{source.name} was built again: its loader uses other flags")

    monkeypatch.setattr(native, "_compile", no_compiling)
    loaders = [
        cpu_attention.load_kernel,
        cpu_attention.load_prefill_kernel,
        fused_ops.load_ops,
        greedy.load_argmax,
        bnb_linear.load_kernel,
    ]
    try:
        for loader in loaders:
            loader.cache_clear()
            assert loader() is not None, loader.__qualname__
    finally:
        for loader in loaders:
            loader.cache_clear()


def test_a_recipe_builds_the_kernels_ahead_when_its_evals_run_the_engine() -> None:
    from evals.settings import Evals

    def runs(evals: dict) -> bool:
        return Evals.model_validate(evals).run_the_engine

    assert runs({"quality": ["corpus_ppl"], "backend": "engine"})
    assert runs({"chat_prompts": ["Hello"]})
    assert runs({"load": {"concurrency": [1], "prompt_len": [8]}})
    assert not runs({"quality": ["corpus_ppl"]})  # HFLM
    assert not runs({"divergence": {"reference": "base"}})
    assert not runs({})
