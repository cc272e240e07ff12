"""Where each task attempt records that it started, for the driver's progress lines: one small
JSON file per node in a dir of the run's storage (a path every node mounts, or `<url>/.tasks/`).

Model: a worker writes `{attempt, where, pid}` when an attempt starts (the attempt number one
past the previous record's); the driver polls the records. A record on a path is replaced
atomically; one at a URL is written whole (object stores publish a put at once). The driver
removes the dir when the run ends.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.remote_store import is_url


@dataclass(frozen=True)
class TaskStatus:
    where: str
    """A dir path, or an fsspec URL."""

    def _name(self, key: str) -> str:
        return f"{key.replace('/', '_').replace(':', '_')}.json"

    def read(self, key: str) -> dict[str, Any] | None:
        try:
            if not is_url(self.where):
                return dict(json.loads((Path(self.where) / self._name(key)).read_text()))
            import fsspec

            fs, root = fsspec.core.url_to_fs(self.where)
            return dict(json.loads(fs.cat_file(f"{root}/{self._name(key)}")))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def write(self, key: str, record: dict[str, Any]) -> None:
        text = json.dumps(record)
        if not is_url(self.where):
            file = Path(self.where) / self._name(key)
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(file)
            return
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.where)
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(f"{root}/{self._name(key)}", text.encode())

    def remove(self) -> None:
        if not is_url(self.where):
            shutil.rmtree(self.where, ignore_errors=True)
            return
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.where)
        if fs.exists(root):
            fs.rm(root, recursive=True)
