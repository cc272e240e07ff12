"""The executor seam without Ray: the local executor is the default and imports no Ray, the
driver lease, and the run command's bad input refused before any work starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.lease import LEASE, STALE_AFTER_S, Lease, LeaseError, driver_lease, read_lease

RECIPE = "name: tiny\nbase: demo-tiny\nvariants:\n  - {name: base, steps: []}\n"

_LOCAL_RUN = """
import sys
from pathlib import Path
import workbench.cli, workbench.run_recipe, workbench.executor
from workbench.pipeline import Pipeline
from workbench.recipe import load_recipe
recipe, base = load_recipe(sys.argv[1])
results = Pipeline(recipe, base, Path(sys.argv[2])).run()
assert [r.status for r in results] == ["built"], results
print("ray" in sys.modules, [m for m in sys.modules if m.startswith("ray.")][:3])
"""


@pytest.mark.e2e
def test_the_local_executor_never_imports_ray(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(RECIPE)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOCAL_RUN,
            str(tmp_path / "r.yaml"),
            str(tmp_path / "w"),
            str(tmp_path / "report"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert out.strip().splitlines()[-1] == "False []"


def _write_lease(work: Path, host: str, pid: int, age_s: float) -> None:
    work.mkdir(parents=True, exist_ok=True)
    lease = {"run_id": "other", "host": host, "pid": pid, "heartbeat": time.time() - age_s}
    (work / LEASE).write_text(json.dumps(lease))


def test_a_live_driver_on_another_machine_keeps_the_work_dir(tmp_path: Path) -> None:
    _write_lease(tmp_path, "elsewhere", 12345, age_s=1)
    with (
        pytest.raises(LeaseError, match=r"elsewhere:12345 holds this work dir"),
        driver_lease(tmp_path),
    ):
        pass
    assert read_lease(tmp_path) == Lease(
        "other", "elsewhere", 12345, pytest.approx(time.time() - 1, abs=5)
    )


def test_a_dead_drivers_lease_is_taken_over(tmp_path: Path) -> None:
    """Stale on another machine (no heartbeat for STALE_AFTER_S), or a dead pid here."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    for host, pid, age in (
        ("elsewhere", 12345, STALE_AFTER_S + 1),
        (socket.gethostname(), dead.pid, 0),
    ):
        _write_lease(tmp_path, host, pid, age)
        with driver_lease(tmp_path) as lease:
            assert read_lease(tmp_path) == lease and lease.pid == os.getpid()
        assert read_lease(tmp_path) is None  # released


def _run(tmp_path: Path, *flags: str) -> int:
    (tmp_path / "r.yaml").write_text(RECIPE)
    return main(["run", str(tmp_path / "r.yaml"), *flags])


@pytest.mark.parametrize(
    ("case", "flags", "message"),
    [
        (
            "address without ray",
            ["--address", "127.0.0.1:1"],
            "--address joins a Ray cluster: add --executor ray",
        ),
        (
            "storage and work dir",
            ["--storage", "{tmp}/s", "--work-dir", "{tmp}/w"],
            "pass one of them",
        ),
        ("storage url without its backend", ["--storage", "s3://bucket/runs"], "pip install s3fs"),
        (
            "storage url of no known scheme",
            ["--storage", "nosuch://b/r"],
            "nosuch:// is not readable",
        ),
        ("storage not writable", ["--storage", "{tmp}/a-file/runs"], "not writable here"),
        (
            "unreachable address",
            ["--executor", "ray", "--address", "127.0.0.1:1", "--storage", "{tmp}/s"],
            "cannot reach a Ray head there",
        ),
    ],
)
def test_bad_run_input_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, flags: list[str], message: str
) -> None:
    (tmp_path / "a-file").write_text("")
    started = time.monotonic()
    code = _run(tmp_path, *[f.format(tmp=tmp_path) for f in flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, (case, err)
    assert time.monotonic() - started < 60  # refused, not retried for minutes
    assert not list(tmp_path.glob("*/variants"))
