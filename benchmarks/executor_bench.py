"""The Ray executor's cost and gain against the local one: the same recipe under both, in one
process run, alternating round by round (local, ray, local, ray, ...), each round in fresh work
dirs so everything is built and measured again.

`python -m benchmarks.executor_bench [--rounds 3] [--recipe FILE] [--variants 4]` runs two
workloads and prints, for each, the median of the per-round ray/local wall-time ratios with
their min and max:

- `toy`: a demo-toy-like recipe on the tiny demo model (or `--recipe`, e.g.
  recipes/demo-toy.yaml on a quiet machine): the executor's overhead; target <= 1.3x.
- `independent`: `--variants` LoRA variants with nothing in common, one CPU each: what running
  them side by side gains on the machine's cores; target <= 0.65x on 2 cores.

Ray starts once, before the first round, and one untimed warm-up run of the toy recipe under it
starts its worker processes (each imports torch and transformers once); start-up and warm-up
are printed apart, not in the ratios. The workers then stay up across rounds, as on a cluster.
Usage statistics are off; Ray listens on loopback only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TOY = """\
name: toy
base: demo-tiny
device: cpu
variants:
  - {name: base, steps: []}
  - {name: int8, steps: [{quantize: {method: bnb-int8}}]}
  - {name: nf4, steps: [{quantize: {method: bnb-nf4, double_quant: true}}]}
  - name: shop-lora
    steps: [{lora: {rank: 4, targets: [q_proj, v_proj], data: shift, steps: 40, lr: 0.003}}]
evals:
  quality: [{task: corpus_ppl, limit: 8}]
  max_length: 64
"""


def independent_recipe(variants: int, steps: int = 400) -> str:
    """`variants` LoRA variants that share no step (each its own rank), one CPU each."""
    lines = ["name: independent", "base: demo-tiny", "device: cpu", "variants:"]
    for i in range(variants):
        lora = f"{{rank: {2 + 2 * i}, targets: [q_proj, v_proj], data: shift, steps: {steps}}}"
        lines.append(f"  - {{name: lora{i}, steps: [{{lora: {lora}}}], resources: {{cpus: 1}}}}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Ratio:
    median: float
    low: float
    high: float

    def line(self, name: str, target: float) -> str:
        verdict = "meets" if self.median <= target else "misses"
        return (
            f"{name}: ray/local wall time x{self.median:.2f} (min {self.low:.2f}, max "
            f"{self.high:.2f}); {verdict} the target x{target:.2f}"
        )


def ratio(rounds: list[tuple[float, float]]) -> Ratio:
    """The per-round ratios of (local seconds, ray seconds) summarized."""
    ratios = [ray_s / local_s for local_s, ray_s in rounds]
    return Ratio(statistics.median(ratios), min(ratios), max(ratios))


def _timed(recipe: Path, root: Path, name: str, executor: object) -> float:
    from workbench.run_recipe import run

    started = time.perf_counter()
    run(recipe, root / name, report_dir=root / f"{name}-report", executor=executor)  # type: ignore[arg-type]
    return time.perf_counter() - started


def measure(recipe_text: str, rounds: int, root: Path) -> list[tuple[float, float]]:
    from workbench.executor import LocalExecutor
    from workbench.ray_executor import RayExecutor

    root.mkdir(parents=True, exist_ok=True)
    recipe = root / "recipe.yaml"
    recipe.write_text(recipe_text)
    found = []
    for i in range(rounds):
        local_s = _timed(recipe, root, f"local-{i}", LocalExecutor())
        ray_s = _timed(recipe, root, f"ray-{i}", RayExecutor())
        print(f"  round {i + 1}: local {local_s:.1f} s, ray {ray_s:.1f} s", flush=True)
        found.append((local_s, ray_s))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recipe", type=Path, help="the overhead workload (default: a toy one)")
    parser.add_argument("--variants", type=int, default=4)
    args = parser.parse_args()
    from workbench.ray_executor import loopback_only

    loopback_only()
    import ray

    started = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False)
    cpus = ray.cluster_resources().get("CPU", 0)
    print(f"ray start-up {time.perf_counter() - started:.1f} s, {cpus:g} CPUs", flush=True)
    toy = args.recipe.read_text() if args.recipe else TOY
    with tempfile.TemporaryDirectory(prefix="executor-bench-") as tmp:
        warm = Path(tmp) / "warm-up"
        warm.mkdir()
        (warm / "recipe.yaml").write_text(toy)
        from workbench.ray_executor import RayExecutor

        warm_s = _timed(warm / "recipe.yaml", warm, "ray", RayExecutor())
        print(f"warm-up (ray, workers started): {warm_s:.1f} s", flush=True)
        print("toy (overhead):", flush=True)
        overhead = ratio(measure(toy, args.rounds, Path(tmp) / "toy"))
        print("independent variants (side by side):", flush=True)
        gain = ratio(measure(independent_recipe(args.variants), args.rounds, Path(tmp) / "ind"))
    print(overhead.line("toy", 1.3))
    print(gain.line(f"{args.variants} independent variants, 1 CPU each", 0.65))


if __name__ == "__main__":
    main()
