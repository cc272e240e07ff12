"""How long `make demo` takes on a fresh clone, by phase and by variant.

`python -m benchmarks.demo_time [--repo .] [--commit HEAD] [--target demo] [--keep DIR]
[--cold-uv] [--drop VARIANT ...]`

Model: the commit is cloned into a new directory (`--keep DIR`, else a temporary one, removed
after) and `make <target>` runs there alone, as a new user's first run does: its own venv, an
empty `$WORKBENCH_CACHE_DIR` (so the GGUF conversion and the kernels' build are timed) and, with
`--cold-uv`, an empty uv cache of its own (the user's is left alone); `--drop` takes variants out
of the clone's copy of the recipe first (the demo as it was before they were added: issue 25's
15 minutes count the eight variants of 2026-12-01, `--drop student-removal`). Its output goes to
`demo.log` in the clone. What it wrote says when each piece ended: the venv's install stamp,
each variant's manifest (`runs/<name>/variants/*/workbench.json`), each variant's stored evals
(`runs/<name>/evals/*/*.json`) and the report. The phases are the spans between them, in the
order the pipeline runs them (install, variants, lm-eval and divergence, serving, report); the
timeline lists every piece with the seconds since the piece before it. Max RSS is the largest
of the run's processes (`getrusage` of the children, as `/usr/bin/time -v` reports it).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from evals import stored

EVALS = {
    stored.QUALITY: "evals",
    stored.DIVERGENCE: "evals",
    stored.SERVER_CHECK: "serving",
    stored.ANSWERS: "serving",
    stored.LOAD: "serving",
}
"""What a run keeps of each variant (`evals.stored`) -> the phase that measures it."""
PHASES = ("install", "variants", "evals", "serving", "report")
TARGETS = ("demo", "demo-toy")
"""The make targets timed: each runs `recipes/<target>.yaml`."""


@dataclass(frozen=True)
class Piece:
    ended: float
    phase: str
    what: str


def pieces(clone: Path, recipe_name: str) -> list[Piece]:
    """What a finished run left behind, in the order it was written."""
    out: list[Piece] = []
    stamp = clone / ".venv" / ".installed"
    if stamp.exists():
        out.append(Piece(stamp.stat().st_mtime, "install", "venv installed"))
    run = clone / "runs" / recipe_name
    for manifest in (run / "variants").glob("*/workbench.json"):
        out.append(Piece(manifest.stat().st_mtime, "variants", f"{manifest.parent.name} built"))
    for variant in (p for p in (run / "evals").glob("*") if p.is_dir()):
        for what, phase in EVALS.items():
            kept = stored.result_path(run, variant.name, what)
            if kept.exists():
                out.append(Piece(kept.stat().st_mtime, phase, f"{variant.name} {what}"))
    report = clone / "reports" / recipe_name / "report.json"
    if report.exists():
        out.append(Piece(report.stat().st_mtime, "report", "report written"))
    return sorted(out, key=lambda p: p.ended)


def phase_spans(started: float, ended: float, found: list[Piece]) -> dict[str, float]:
    """Seconds of each phase: from the last piece of the phases before it to its own last piece;
    the report phase runs to the end of the run, and a run without a report ends `unfinished`
    (the span from its last piece to its end: where it stopped)."""
    spans: dict[str, float] = {}
    since = started
    for phase in PHASES:
        times = [p.ended for p in found if p.phase == phase]
        if not times:
            continue
        last = ended if phase == "report" else max(times)
        spans[phase] = last - since
        since = last
    if "report" not in spans:
        spans["unfinished"] = ended - since
    return spans


def clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}:{rest:02d}"


def recipe_name(clone: Path, target: str) -> str:
    """The name (so the run directory) of the recipe `make <target>` runs."""
    if target not in TARGETS:
        raise SystemExit(f"--target {target}: this script times `demo` or `demo-toy`")
    name = yaml.safe_load((clone / "recipes" / f"{target}.yaml").read_text()).get("name")
    if not name:
        raise SystemExit(f"recipes/{target}.yaml has no `name`")
    return str(name)


def drop_variants(recipe_path: Path, names: list[str]) -> int:
    """Rewrites the recipe without the named variants (anchors expanded, comments dropped) and
    validates it; returns how many variants remain. SystemExit naming the problem where a name
    is not one of its variants or the recipe without them is not valid."""
    from workbench.recipe import load_recipe
    from workbench.recipe_errors import RecipeError

    data = yaml.safe_load(recipe_path.read_text())
    have = [variant["name"] for variant in data["variants"]]
    unknown = [name for name in names if name not in have]
    if unknown:
        raise SystemExit(
            f"--drop {', '.join(unknown)}: not a variant of {recipe_path.name} "
            f"(it has {', '.join(have)})"
        )
    data["variants"] = [v for v in data["variants"] if v["name"] not in names]
    recipe_path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        load_recipe(recipe_path)
    except RecipeError as e:
        raise SystemExit(f"--drop {', '.join(names)}: {e}") from None
    return len(data["variants"])


def clone_at(repo: str, commit: str, clone: Path) -> str:
    """`repo` cloned into `clone` at `commit`; returns the commit's short hash."""
    subprocess.run(["git", "clone", "-q", repo, str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
    return subprocess.run(
        ["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def print_timing(rc: int, started: float, ended: float, found: list[Piece]) -> None:
    rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
    print(f"exit {rc}, {clock(ended - started)} wall, max RSS {rss_gb:.1f} GB")
    spans = phase_spans(started, ended, found)
    print("  ".join(f"{phase} {clock(seconds)}" for phase, seconds in spans.items()))
    since = started
    for piece in found:
        print(f"  {clock(piece.ended - started):>6}  +{piece.ended - since:6.1f} s  {piece.what}")
        since = piece.ended


def timed_run(args: argparse.Namespace, scratch: Path) -> int:
    clone = args.keep or scratch / "clone"
    commit = clone_at(args.repo, args.commit, clone)
    name = recipe_name(clone, args.target)
    if args.drop:
        left = drop_variants(clone / "recipes" / f"{args.target}.yaml", args.drop)
        print(f"recipes/{args.target}.yaml without {', '.join(args.drop)}: {left} variants")
    env = dict(os.environ, WORKBENCH_CACHE_DIR=str(scratch / "cache"))
    if args.cold_uv:
        env["UV_CACHE_DIR"] = str(scratch / "uv-cache")
    print(f"make {args.target} on a fresh clone of {commit} in {clone} (log: demo.log there)")
    started = time.time()
    with open(clone / "demo.log", "w") as log:
        rc = subprocess.run(
            ["make", args.target], cwd=clone, env=env, stdout=log, stderr=log
        ).returncode
    print_timing(rc, started, time.time(), pieces(clone, name))
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repo", default=".", help="the repository to clone")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--target", default="demo", help="the make target: demo or demo-toy")
    ap.add_argument("--keep", type=Path, help="clone into this new directory and keep it")
    ap.add_argument("--cold-uv", action="store_true", help="an empty uv cache for the install")
    ap.add_argument("--drop", nargs="+", default=[], help="variants taken out of the recipe")
    args = ap.parse_args(argv)
    if args.keep is not None and args.keep.exists():
        raise SystemExit(f"--keep {args.keep}: exists; give a new directory")
    scratch = Path(tempfile.mkdtemp(prefix="demo-time-"))
    try:
        return timed_run(args, scratch)
    finally:  # also on errors and interrupts
        shutil.rmtree(scratch, ignore_errors=True)  # the caches, and the clone unless kept


if __name__ == "__main__":
    sys.exit(main())
