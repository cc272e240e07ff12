"""The `workbench` command line: validate and run recipes (variants, evals, report), serve,
benchmark, export a variant, compare runs on the dashboard, build the demo model."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from catalog.gguf_file import BadGGUF
from evals.load_cli import add_bench_arguments
from reports.gates import exit_code
from reports.records import Report
from serve.http.cli import add_serve_arguments
from serve.model.host_memory import keep_freed_memory
from workbench.cli_arguments import (
    add_dashboard_arguments,
    add_export_arguments,
    add_run_arguments,
)
from workbench.executor import Executor, ExecutorError, LocalExecutor
from workbench.lease import LeaseError
from workbench.pipeline import Pipeline, PipelineError, VariantResult
from workbench.recipe import RecipeError, load_recipe
from workbench.storage import StorageError, storage_path

# markup off: paths, names and messages are printed as they are ("runs/[/]x" is a path)
console = Console(stderr=True, markup=False)
out = Console(width=None if sys.stdout.isatty() else 160, markup=False)  # logs get whole tables


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def cmd_validate(args: argparse.Namespace) -> int:
    """The schema, then the steps' own checks (order, quantized inputs, targets when the base
    is at hand): what validate accepts, run does not refuse."""
    from workbench.base_model import base_dir_if_present
    from workbench.model_shape import module_names, position_limit

    recipe, base = load_recipe(args.recipe)
    base_dir = base_dir_if_present(base)
    names = module_names(base_dir) if base_dir is not None else None
    limit = position_limit(base_dir) if base_dir is not None else None
    Pipeline(recipe, base, Path()).check(recipe.variants, names, limit)
    out.print(
        f"{args.recipe}: ok: recipe {recipe.name!r}, base {base.name!r} ({base.kind}), "
        f"{len(recipe.variants)} variant(s): {', '.join(v.name for v in recipe.variants)}"
    )
    if names is None:
        out.print(
            "  (module names and lengths not checked: the base is not built or downloaded yet)"
        )
    return 0


def _variants_table(results: list[VariantResult]) -> Table:
    table = Table(title="variants")
    for col in ("variant", "status", "kind", "parameters", "on disk", "wall", "peak RSS"):
        table.add_column(
            col, justify="right" if col in ("parameters", "on disk", "wall", "peak RSS") else "left"
        )
    for r in results:
        m = r.manifest
        table.add_row(
            r.name,
            r.status,
            m.kind,
            f"{m.parameters:,}",
            _size(m.bytes_on_disk),
            f"{m.wall_seconds:.1f} s",
            _size(m.peak_memory_bytes),
        )
    return table


def cmd_run(args: argparse.Namespace) -> int:
    from workbench.run_recipe import run

    def show(r: VariantResult) -> None:
        status = "built " if r.status == "built" else "reused"
        console.print(Text.assemble(f"  {status} ", (r.name, "bold"), f" -> {r.path}"))
        if r.rebuilt_because:
            console.print(
                Text.assemble("    ", ("rebuilt, not reused:", "yellow"), f" {r.rebuilt_because}")
            )

    try:
        result = run(
            args.recipe,
            _work_dir(args),
            variants=args.variant,
            force=args.force,
            keep_checkpoints=args.keep_checkpoints,
            on_variant=show,
            progress=lambda line: console.print(f"  {line}"),
            executor=_executor(args),
        )
    except (ExecutorError, LeaseError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result.report is None:  # a non-main process of a distributed run
        return 0
    out.print(_variants_table(result.variants))
    out.print(
        f"built {len(result.built)} variant(s) {result.built}, reused {len(result.reused)} "
        f"{result.reused}; manifests in {result.work_dir / 'variants'}/*/workbench.json"
    )
    report = Report.from_json(result.report)
    out.print(_report_table(report))
    out.print(
        f"report: {result.report_dir / 'index.html'} "
        f"(figures in {result.report_dir / 'report.json'})"
    )
    for problem in report.problems:
        console.print(Text.assemble(("problem: ", "bold red"), problem))
    return exit_code(report.problems, report.gates)


def _work_dir(args: argparse.Namespace) -> Path | str | None:
    """--storage (the dir every node mounts, or an fsspec URL) or --work-dir; StorageError for
    both."""
    if args.storage and args.work_dir:
        raise StorageError("--storage and --work-dir name the same dir: pass one of them")
    return storage_path(args.storage) if args.storage else args.work_dir


def _executor(args: argparse.Namespace) -> Executor:
    if args.executor == "local":
        if args.address:
            raise ExecutorError("--address joins a Ray cluster: add --executor ray")
        return LocalExecutor()
    from workbench.ray_executor import RayExecutor

    return RayExecutor(address=args.address, max_retries=args.max_retries)


def _report_table(report: Report) -> Table:
    """The report's headline figures under short labels (report.md has them all): weights, each
    task's headline metric, the paired verdicts, peak throughput, saturation and capacity."""
    from reports.render import fmt

    table = Table(title=report.title)
    cols = [c for c in report.columns if c.short]
    for c in cols:
        table.add_column(c.short or c.key, justify="left" if c.format == "text" else "right")
    for v in report.variants:
        table.add_row(*(fmt(v.value(c.key), c.format) for c in cols))
    return table


def cmd_demo_model(args: argparse.Namespace) -> int:
    from catalog import build_info, ensure_demo_model

    path = ensure_demo_model(args.name)
    info = build_info(path)
    out.print(f"{args.name}: {path}")
    for key in (
        "parameters",
        "train_tokens",
        "build_seconds",
        "validation_perplexity",
        "unigram_validation_perplexity",
        "shifted_validation_perplexity",
    ):
        value = info[key]
        out.print(
            f"  {key:32s} {value:,.2f}" if isinstance(value, float) else f"  {key:32s} {value:,}"
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from serve.http.cli import resolve_model_name, run_server

    resolve_model_name(args)
    return run_server(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from evals.load_cli import failed_requests, print_summary, run_bench
    from workbench.base_model import named_model_dir

    serve_flags = list(args.serve_flags)
    model_dir = named_model_dir(args.model) if args.model else None
    if model_dir is not None:
        serve_flags += ["--served-model-name", Path(args.model).stem]
        args.model = str(model_dir)
    result = run_bench(args, serve_flags)
    print_summary(result)
    out.print(f"wrote {args.out}")
    failed = failed_requests(result)
    if failed:
        console.print(f"workbench bench: {failed} request(s) failed; see {args.out}")
        return 1
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from reports.dashboard import serve_dashboard

    serve_dashboard(
        Path(args.reports), args.host, args.port, args.allowed_hosts, args.allowed_origins
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from compress.export import ExportError, export

    source = Path(args.variant)
    out_dir = (
        Path(args.out)
        if args.out
        else source.parent.parent / "exports" / (f"{source.name}-{args.format}")
    )
    try:
        info = export(source, args.format, out_dir, args.gguf_type, args.llama_quantize)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.print(f"{source} -> {info['path']} ({args.format}, {_size(info['bytes'])})")
    if "base" in info:  # an adapter: llama.cpp applies it to its base's GGUF export
        out.print(
            f"  a GGUF LoRA for the base at {info['base']}: llama-cli -m BASE.gguf --lora "
            f"{info['path']} (BASE.gguf: `workbench export <base variant> --format gguf`)"
        )
    for scheme, modules in info["schemes"].items():
        if args.format == "gguf":
            out.print(f"  {scheme}: {modules[0]}")
        else:
            out.print(f"  {scheme} ({info['layout'] or 'dense'}): {len(modules)} module(s)")
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    """This process becomes `python -m benchmarks.engine_bench ARGS` (its signals and exit code
    its own): `benchmarks` is the layer above the packages, which never import it."""
    command = [sys.executable, "-m", "benchmarks.engine_bench", *args.args]
    os.execv(sys.executable, command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a recipe file and report every problem")
    p.add_argument("recipe", help="path of the recipe YAML")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("run", help="build every variant of a recipe (reusing unchanged ones)")
    p.add_argument("recipe", help="path of the recipe YAML")
    add_run_arguments(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("demo-model", help="build (first use) and describe the offline demo model")
    p.add_argument("--name", default="demo", choices=["demo", "demo-tiny"], help="which spec")
    p.set_defaults(func=cmd_demo_model)
    p = sub.add_parser("serve", help="serve a model or variant over an OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser(
        "bench",
        help="load benchmark over HTTP: ramp concurrency per prompt length, find KV saturation "
        "(other flags go to the server it starts)",
    )
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser(
        "bench-engine",
        add_help=False,
        help="engine throughput vs transformers' static and continuous batching (--help for more)",
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench_engine)
    p = sub.add_parser(
        "export",
        help="write a variant in a format other engines load (hf, compressed-tensors, gguf)",
    )
    add_export_arguments(p)
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("dashboard", help="serve a page comparing the runs and variants in reports/")
    add_dashboard_arguments(p)
    p.set_defaults(func=cmd_dashboard)
    return parser


def exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM and SIGHUP end a command as an exception does: `finally` blocks and exit
    handlers run, so every process it started (the evals' servers) is stopped and no
    half-written file is left; the same signal again is ignored while that happens."""
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = build_parser().parse_known_args(argv)
    keep_freed_memory()
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, exit_on_signal)
    if args.command == "bench-engine":
        args.args = extra + args.args
    elif args.command == "bench":
        args.serve_flags = extra
    elif extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (RecipeError, BadGGUF) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PipelineError as e:
        print(
            f"error: {args.recipe}: " + f"\nerror: {args.recipe}: ".join(e.problems),
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
