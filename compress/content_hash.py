"""Content hashes of local files, cached by (path, size, mtime) so a large base is read once.

Model: `sha256_cached(file)` returns the file's sha256; the cache (`file-hashes.json` in the
workbench cache dir) maps the resolved path to (size, mtime_ns, sha256) and is trusted only while
size and mtime are unchanged, so re-saving a file in place (new mtime) rehashes it. The cache is
rewritten atomically; concurrent writers at worst lose each other's entries, never corrupt them.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from compress.artifact import file_sha256
from compress.cache import cache_dir

CACHE_FILE = "file-hashes.json"


def _load(path: Path) -> dict[str, list]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def sha256_cached(files: list[Path]) -> dict[Path, str]:
    """sha256 of each file, reading only those whose size or mtime changed since last time."""
    store = cache_dir() / CACHE_FILE
    cache = _load(store)
    out, changed = {}, False
    for file in files:
        key = str(file.resolve())
        stat = file.stat()
        entry = cache.get(key)
        if not (isinstance(entry, list) and entry[:2] == [stat.st_size, stat.st_mtime_ns]):
            entry = [stat.st_size, stat.st_mtime_ns, file_sha256(file)]
            cache[key], changed = entry, True
        out[file] = entry[2]
    if changed:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f".{CACHE_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(cache))
        tmp.replace(store)
    return out
