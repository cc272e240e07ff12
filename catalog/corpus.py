"""The base corpus of the offline demo model: real English text that every CPython ships.

Model: a *document* is one stdlib module's docstrings (module, classes, functions, joined in source
order) or one `pydoc_data.topics` entry. Documents are split into train / validation / test by a
hash of their id, so the split never depends on file order or on how many documents there are.

The text changes slightly between Python versions, so the project ships a snapshot
(`data/corpus.jsonl.xz`, extracted from CPython 3.11; Python Software Foundation License) and the
demo model is trained from it: the same bytes on every machine. `extract_stdlib_documents()` is the
extractor that wrote it; `python -m catalog.corpus --write-snapshot` writes it again.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import lzma
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SNAPSHOT = Path(__file__).parent / "data" / "corpus.jsonl.xz"
SPLITS = ("train", "validation", "test")
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


@dataclass(frozen=True)
class Document:
    id: str
    source: str
    text: str

    @property
    def split(self) -> str:
        """90 / 5 / 5 by a stable hash of the document id."""
        bucket = int(hashlib.sha256(self.id.encode()).hexdigest()[:8], 16) % 100
        return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def _module_docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    return [d for n in nodes if (d := ast.get_docstring(n, clean=True))]


def _stdlib_sources(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith("test_")
        )
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                yield Path(dirpath) / name


def extract_stdlib_documents() -> list[Document]:
    """Docstrings of the running interpreter's stdlib (tests excluded) and pydoc's topics."""
    import pydoc_data.topics

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in _stdlib_sources(root):
        docstrings = _module_docstrings(path)
        if docstrings:
            module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
            docs.append(Document(f"stdlib:{module}", "stdlib-docstrings", "\n\n".join(docstrings)))
    for topic, text in sorted(pydoc_data.topics.topics.items()):
        docs.append(Document(f"pydoc:{topic}", "pydoc-topics", text.strip()))
    return docs


def write_snapshot(docs: list[Document], path: Path = SNAPSHOT) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(d.__dict__, ensure_ascii=False) + "\n" for d in docs)
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as f:
        f.write(lines)


def load_documents(path: Path = SNAPSHOT) -> list[Document]:
    """The shipped snapshot, in its stored order."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [Document(**json.loads(line)) for line in f]


def split_texts(docs: list[Document]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for d in docs:
        out[d.split].append(d.text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-snapshot", action="store_true", help="re-extract and overwrite")
    args = parser.parse_args()
    docs = extract_stdlib_documents() if args.write_snapshot else load_documents()
    if args.write_snapshot:
        write_snapshot(docs)
    for split, texts in split_texts(docs).items():
        print(f"{split:>10}: {len(texts):5d} documents, {sum(map(len, texts)):9,d} chars")


if __name__ == "__main__":
    main()
