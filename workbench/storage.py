"""The work dir as storage every task writes to: where it is, whether it can be written, and the
one point in an artifact's commit a test may hold.

Model (the commit protocol, `workbench.build_task`): a task writes an artifact into a hidden
temporary dir beside its target (`.NAME.tmp-PID-...`), writes the manifest last, and renames the
dir into place: `artifacts/<hash>/` or `variants/<name>/` either does not exist or is complete,
and a reader ignores any dir without a manifest. Two attempts at one hash are harmless: each
writes its own temporary dir, and the later rename replaces one complete artifact with another.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

GATE_ENV = "WORKBENCH_COMMIT_GATE"
"""A dir; while `<dir>/<hash>.hold` exists, a task about to write the manifest of artifact
`<hash>` announces itself in `<dir>/<hash>.waiting-<pid>` and waits. Lets a test kill a worker
at exactly that point (never set in normal use)."""


class StorageError(ValueError):
    """The work dir cannot serve as the run's storage."""


def storage_path(value: str) -> Path | str:
    """A path or a `file://` URL as an absolute path; any other URL as it is (fsspec storage:
    `workbench.remote_store`)."""
    parsed = urlparse(value)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else value).expanduser().absolute()
    return value


def check_writable(work_dir: Path) -> None:
    """Raise StorageError naming the fix when this process cannot create files in `work_dir`."""
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        probe = work_dir / f".probe-{uuid.uuid4().hex[:8]}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise StorageError(
            f"--storage {work_dir}: not writable here ({e.strerror or e}); pass a dir this user "
            f"can write on every node"
        ) from None


def commit_gate(artifact_hash: str) -> None:
    """Wait while the test's gate holds `artifact_hash` (see GATE_ENV); returns at once else."""
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return
    hold = Path(gate) / f"{artifact_hash}.hold"
    if not hold.exists():
        return
    (Path(gate) / f"{artifact_hash}.waiting-{os.getpid()}").write_text(str(os.getpid()))
    while hold.exists():
        time.sleep(0.05)
