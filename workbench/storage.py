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
import shutil
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


def is_url(value: str | Path) -> bool:
    """A storage URL other than a path or `file://` (fsspec storage: `workbench.remote_store`)."""
    return isinstance(value, str) and urlparse(value).scheme not in ("", "file")


def storage_path(value: str) -> Path | str:
    """A path or a `file://` URL as an absolute path; any other URL as it is."""
    if is_url(value):
        return value
    parsed = urlparse(value)
    return Path(parsed.path if parsed.scheme else value).expanduser().absolute()


def read_text(where: str) -> str:
    """The small file at `where` (a path or an fsspec URL); FileNotFoundError when absent."""
    if not is_url(where):
        return Path(where).read_text()
    import fsspec

    fs, path = fsspec.core.url_to_fs(where)
    return bytes(fs.cat_file(path)).decode()


def write_text(where: str, text: str) -> None:
    """`text` as the file at `where`, whole: a path is replaced atomically (a temporary file
    beside it renamed over it); an object store publishes a put at once."""
    if not is_url(where):
        file = Path(where)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(file)
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(where)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, text.encode())


def remove(where: str) -> None:
    """The file or dir at `where` gone, with everything in it; nothing when it is absent."""
    if not is_url(where):
        shutil.rmtree(where, ignore_errors=True)
        Path(where).unlink(missing_ok=True)
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(where)
    if fs.exists(path):
        fs.rm(path, recursive=True)


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
