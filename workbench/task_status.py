"""Where each task attempt records that it started, for the driver's progress lines: one small
JSON file per node in a dir of the run's storage (a path every node mounts, or `<url>/.tasks/`).

Model: a worker writes `{attempt, where, pid}` when an attempt starts (the attempt number one
past the previous record's); the driver polls the records. Each record is written whole
(`workbench.storage.write_text`). The driver removes the dir when the run ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workbench.storage import read_text, remove, write_text


@dataclass(frozen=True)
class TaskStatus:
    where: str
    """A dir path, or an fsspec URL."""

    def _file(self, key: str) -> str:
        return f"{self.where}/{key.replace('/', '_').replace(':', '_')}.json"

    def read(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(json.loads(read_text(self._file(key))))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def write(self, key: str, record: dict[str, Any]) -> None:
        write_text(self._file(key), json.dumps(record))

    def remove(self) -> None:
        remove(self.where)
