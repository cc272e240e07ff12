"""Shared fixtures: an isolated cache and hub home, offline, and the tiny demo model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session", autouse=True)
def _isolated_dirs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A per-session HF home; the demo cache stays shared when CI or the user set one."""
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home"))
    os.environ.setdefault("WORKBENCH_CACHE_DIR", str(tmp_path_factory.mktemp("workbench_cache")))


@pytest.fixture(scope="session")
def tiny_model_dir(_isolated_dirs: None) -> Path:
    from catalog import ensure_demo_model

    return ensure_demo_model("demo-tiny")


# Tests must not write into the checkout (a stray reports/<run>/ shows up on the user's
# dashboard): the files git does not track are listed at the start and at the end of the session,
# and anything new fails the run.
CHECKOUT = Path(__file__).resolve().parents[1]
GIT_STATUS = ("git", "status", "--porcelain", "--ignored", "--untracked-files=all")
CACHES = (".pytest_cache", "__pycache__", ".hypothesis", ".ruff_cache", ".mypy_cache")


def _untracked() -> set[str] | None:
    import subprocess

    try:
        out = subprocess.run(
            [*GIT_STATUS, "--", ".", ":(exclude).venv"],
            cwd=CHECKOUT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout: nothing to compare
    paths = {line[3:] for line in out.splitlines()}
    kept = _cache_inside_checkout()  # CI keeps the workbench cache in the checkout on purpose
    return {
        p
        for p in paths
        if not any(c in p.split("/") for c in CACHES) and not (kept and p.startswith(kept))
    }


def _cache_inside_checkout() -> str | None:
    """The workbench cache dir as a checkout-relative prefix ("x/"), when it lies inside."""
    value = os.environ.get("WORKBENCH_CACHE_DIR")
    if not value:
        return None
    try:
        return Path(value).resolve().relative_to(CHECKOUT).as_posix() + "/"
    except ValueError:
        return None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_BEFORE] = _untracked()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_BEFORE, None)
    after = _untracked()
    if before is None or after is None or hasattr(session.config, "workerinput"):
        return
    new = sorted(after - before)
    if new:
        session.config.get_terminal_writer().line(
            f"\ntests wrote into the checkout ({len(new)} path(s)): {', '.join(new[:10])}; "
            "write under tmp_path instead",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[set[str] | None]()
