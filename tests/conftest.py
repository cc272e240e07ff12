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
    from workbench.demo import ensure_demo_model

    return ensure_demo_model("demo-tiny")
