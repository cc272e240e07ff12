"""The mixed-precision plan: the exact minimum of summed sensitivity under the budget (checked
by brute force), never over it; and the budget's validation."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from pydantic import ValidationError

from compress.mixed import UNITS, Budget, MixedParams, part_bytes, plan
from compress.registry import StepError
from compress.sensitivity import Part

FORMATS = ["int4-g128", "int4-g32", "int8", "keep"]


def instance(seed: int, n: int) -> tuple[list[Part], dict, dict]:
    rng = random.Random(seed)
    parts = [Part(i, "mlp_in", (f"l{i}",), 0) for i in range(n)]
    shapes = {f"l{i}": (rng.choice([64, 128, 256]), rng.choice([128, 256])) for i in range(n)}
    losses, costs = {}, {}
    for p in parts:
        # sensitivities fall as precision rises, as measured ones do
        base = rng.uniform(0.01, 1.0)
        losses[p.name] = {f: base * s for f, s in zip(FORMATS, [1.0, 0.4, 0.05, 0.0])}
        costs[p.name] = {f: part_bytes(p, f, shapes) for f in FORMATS}
    return parts, losses, costs


@pytest.mark.parametrize("seed", range(12))
def test_plan_is_the_brute_force_optimum_within_budget(seed: int) -> None:
    parts, losses, costs = instance(seed, 5)
    cheapest = sum(min(c.values()) for c in costs.values())
    dearest = sum(max(c.values()) for c in costs.values())
    budget = random.Random(seed).randint(cheapest, dearest)
    chosen = plan(parts, losses, costs, budget)
    spent = sum(costs[p.name][chosen[p.name]] for p in parts)
    assert spent <= budget
    # the optimum over every combination whose costs, rounded up to the plan's unit, fit
    unit = math.ceil(budget / UNITS)
    best = min(
        sum(losses[p.name][f] for p, f in zip(parts, combo))
        for combo in itertools.product(FORMATS, repeat=len(parts))
        if sum(math.ceil(costs[p.name][f] / unit) for p, f in zip(parts, combo)) <= budget // unit
    )
    got = sum(losses[p.name][chosen[p.name]] for p in parts)
    assert got == pytest.approx(best, abs=1e-12)


def test_plan_refuses_a_budget_below_the_cheapest_choice() -> None:
    parts, losses, costs = instance(0, 3)
    cheapest = sum(min(c.values()) for c in costs.values())
    with pytest.raises(StepError, match="cannot hold the planned parts"):
        plan(parts, losses, costs, cheapest - 1)


def test_part_bytes_count_codes_and_float32_scales() -> None:
    part = Part(0, "attn_out", ("o",), 0)
    shapes = {"o": (64, 256)}
    assert part_bytes(part, "int4-g32", shapes) == 64 * 256 // 2 + 64 * 8 * 8
    assert part_bytes(part, "int8", shapes) == 64 * 256 + 64 * 8
    assert part_bytes(part, "keep", shapes) == 64 * 256 * 4


def test_budget_validation_names_the_field() -> None:
    with pytest.raises(ValidationError, match="exactly one of bits_per_weight or size"):
        Budget(bits_per_weight=4.5, size="150MB")
    with pytest.raises(ValidationError, match="write a number and a unit"):
        Budget(size="150 megs")
    assert Budget(size="1.5MiB").size_bytes() == 1572864
    with pytest.raises(ValidationError, match="unknown packed format 'int3'"):
        MixedParams(method="mixed", budget=Budget(bits_per_weight=5), candidates=["int3"])
