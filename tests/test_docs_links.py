"""Every relative link in the README and docs/ names a file that exists, and a heading in it.

Anchors are the ones GitHub renders: a heading's text without its markdown, lower-cased, stripped
of punctuation but hyphens and underscores, spaces turned into hyphens, and `-1`, `-2`, ... on
repeats. Links inside code (fenced blocks and inline spans) are text, not links.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text: str) -> str:
    """The page without its code: fenced blocks and inline code spans blanked out."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub renders for the page's headings, repeats numbered."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            repeats = seen.get(base, 0)
            seen[base] = repeats + 1
            found.add(f"{base}-{repeats}" if repeats else base)
    return found


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def relative_links(page: Path) -> list[str]:
    targets = LINK.findall(prose(page.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file or anchor does not exist, as `target: why`."""
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {shown(dest)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_slug_matches_github_for_punctuation_code_and_repeats(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Measured: moved\n## 2026-12-05: Session 34, at issue 25's closing commit (39d82cc)\n"
        "## `torch.compile` and OMP_WAIT_POLICY=PASSIVE\n## History\n### History\n"
        "```\n# not a heading\n```\n"
    )
    assert anchors(page) == {
        "measured-moved",
        "2026-12-05-session-34-at-issue-25s-closing-commit-39d82cc",
        "torchcompile-and-omp_wait_policypassive",
        "history",
        "history-1",
    }


def test_links_inside_code_are_not_checked(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("`[a](missing.md)`\n```\n[b](missing.md)\n```\n[c](page.md#nowhere)\n")
    assert broken_links(page) == [f"page.md#nowhere: no heading #nowhere in {page}"]


def test_readme_stays_short() -> None:
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_docs_page_over_40_kb(page: Path) -> None:
    assert page.stat().st_size <= 40 * 1024


def mapped_paths(files_md: Path) -> list[tuple[str, str]]:
    """(folder, path) for every path the file map's tables name, in the folder its section sets."""
    folder, out = "", []
    for line in files_md.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            folder = ""
        if m := re.match(r"In `([^`]+/)`:$", line):
            folder = m.group(1)
        if line.startswith("| `"):
            first_cell = line.split(" | ")[0]
            out += [(folder, p) for p in re.findall(r"`([^`]+)`", first_cell)]
    return out


def test_every_path_the_file_map_names_exists() -> None:
    missing = [
        f"{folder}{path}"
        for folder, path in mapped_paths(ROOT / "docs" / "files.md")
        if not any((ROOT / base).glob(path) for base in (folder, ""))
    ]
    assert missing == []
