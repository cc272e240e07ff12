"""A run's storage at an fsspec URL (`s3://`, `gs://`, `az://`, ...), for nodes that share no
file system.

Model: every node works in a local mirror of the storage, at the same path on each node (the
driver picks it: `mirror_dir`), and the URL holds what is committed. A task pulls what it reads
before it runs (its inputs' artifacts, its own target when that is committed already, the stored
eval results), runs against the mirror as it would against a shared dir, and pushes what it
committed: an artifact's files first and its manifest last, the commit marker, as on a shared
dir. A reader takes only a dir whose manifest is at the URL, downloads it beside its target, checks
every file's sha256 against the manifest and renames it into place, so a half-pushed artifact is
never read and a corrupted one is refused. Eval results are small JSON files, pushed and pulled
whole. Checkpoints stay on the node that trains (a retried training starts over).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from compress.artifact import MANIFEST, atomic_dir, verify_files
from workbench.storage import StorageError

MIRROR_ENV = "WORKBENCH_STORAGE_MIRROR"
"""Where the driver puts the local mirrors (default: the system's temporary dir); every node must
be able to create that path."""
EVALS = "evals"
BACKENDS = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def mirror_dir(url: str) -> str:
    root = Path(os.environ.get(MIRROR_ENV) or Path(tempfile.gettempdir()) / "workbench-storage")
    return str(root / hashlib.sha256(url.encode()).hexdigest()[:16])


@dataclass(frozen=True)
class RemoteStore:
    url: str
    local: str
    """The mirror's path (the run's work dir on every node)."""

    @classmethod
    def at(cls, url: str) -> RemoteStore:
        """The store at `url`, checked: its fsspec backend imports and the URL is writable."""
        store = cls(url.rstrip("/"), mirror_dir(url.rstrip("/")))
        store.check()
        return store

    def fs(self) -> tuple[Any, str]:
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as e:
            scheme = urlparse(self.url).scheme
            package = BACKENDS.get(scheme, f"the fsspec backend for {scheme}://")
            raise StorageError(
                f"--storage {self.url}: {scheme}:// is not readable here ({e}); install "
                f"{package} on every node (pip install {package}), or pass a dir every node mounts"
            ) from None
        return fs, str(root).rstrip("/")

    def check(self) -> None:
        """StorageError naming the fix when this process cannot write and read at the URL."""
        fs, root = self.fs()
        probe = f"{root}/.probe-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            fs.makedirs(root, exist_ok=True)
            fs.pipe_file(probe, b"probe")
            seen = fs.cat_file(probe)
            fs.rm_file(probe)
        except Exception as e:  # each backend raises its own errors (botocore, OSError, ...)
            raise StorageError(
                f"--storage {self.url}: not writable from here ({type(e).__name__}: {e}); check "
                f"the bucket's name and this node's credentials"
            ) from None
        if seen != b"probe":
            raise StorageError(
                f"--storage {self.url}: read back {seen[:40]!r}, not what was written"
            )
        Path(self.local).mkdir(parents=True, exist_ok=True)

    def rel(self, path: str | Path) -> str:
        """`path` (in the mirror) relative to the mirror."""
        return Path(path).relative_to(self.local).as_posix()

    def manifest_bytes(self, rel: str) -> bytes | None:
        """The committed manifest of the artifact dir `rel` at the URL, as written, or None."""
        fs, root = self.fs()
        try:
            return bytes(fs.cat_file(f"{root}/{rel}/{MANIFEST}"))
        except FileNotFoundError:
            return None

    def committed(self, rel: str) -> tuple[bytes, dict[str, Any]] | None:
        """The manifest of the artifact dir `rel` at the URL, as written and parsed; None when
        there is none (or it is no JSON object)."""
        raw = self.manifest_bytes(rel)
        try:
            found = json.loads(raw) if raw is not None else None
        except json.JSONDecodeError:
            return None
        return (raw, found) if raw is not None and isinstance(found, dict) else None

    def pull(self, rel: str) -> bool:
        """The artifact dir `rel` into the mirror when the URL has it committed (a verified copy
        there already is kept); whether it is there now. StorageError when the committed files
        do not match their manifest."""
        local = Path(self.local) / rel
        if (committed := self.committed(rel)) is None:
            return False
        raw, found = committed
        if _same_bytes(local / MANIFEST, raw) and verify_files(local, found.get("files")) is None:
            return True
        fs, root = self.fs()
        with atomic_dir(local) as tmp:
            for name in found.get("files") or {}:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{root}/{rel}/{name}", str(tmp / name))
            problem = verify_files(tmp, found.get("files"))
            if problem is not None:
                raise StorageError(
                    f"{self.url}/{rel}: committed, but {problem}; delete that dir at the URL "
                    f"so the next run builds it again"
                )
            (tmp / MANIFEST).write_bytes(raw)
        return True

    def push(self, rel: str) -> None:
        """The committed artifact dir `rel` of the mirror to the URL, its manifest last; nothing
        when the URL holds this very manifest already."""
        local = Path(self.local) / rel
        manifest = (local / MANIFEST).read_bytes()
        if self.manifest_bytes(rel) == manifest:
            return
        fs, root = self.fs()
        for file in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST):
            target = f"{root}/{rel}/{file.relative_to(local).as_posix()}"
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(file), target)
        fs.pipe_file(f"{root}/{rel}/{MANIFEST}", manifest)

    def pull_evals(self) -> None:
        """Every stored eval result at the URL into the mirror (each file whole)."""
        fs, root = self.fs()
        for path in fs.find(f"{root}/{EVALS}"):
            name = path[len(root) + 1 :]
            local = Path(self.local) / name
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}")
            tmp.write_bytes(fs.cat_file(path))
            tmp.replace(local)

    def evals_snapshot(self) -> dict[str, tuple[int, int]]:
        """(size, mtime) of each eval result in the mirror, to push what a task changes."""
        root = Path(self.local) / EVALS
        if not root.is_dir():
            return {}
        return {
            p.relative_to(self.local).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*.json")
            if p.is_file() and not p.name.startswith(".")
        }

    def push_evals(self, before: dict[str, tuple[int, int]]) -> None:
        """Each eval result written since `before` to the URL."""
        fs, root = self.fs()
        for name, stamp in self.evals_snapshot().items():
            if before.get(name) != stamp:
                fs.makedirs(f"{root}/{name}".rsplit("/", 1)[0], exist_ok=True)
                fs.pipe_file(f"{root}/{name}", (Path(self.local) / name).read_bytes())

    def remove_mirror(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)


def _same_bytes(file: Path, content: bytes) -> bool:
    try:
        return file.read_bytes() == content
    except FileNotFoundError:
        return False
