"""Quality gates: bounds a recipe sets on the report's metrics (`gates:`), checked on every
variant but the reference.

Model: a recipe writes `gates: {<kind>: {<name>: threshold}}`. Each kind names a metric family of
the registry (`reports.metrics`), which way it is bounded, and what its names are (the recipe's
quality tasks, or its divergence data sets): `recovery: {hellaswag: 0.95}` asks every variant
for at least 95% of the reference's score on hellaswag (`reports.rows.add_recovery`: variant /
reference accuracy, reference / variant bits per byte for perplexity tasks), `max_kl: {corpus:
0.05}` for a KL against the reference of at most 0.05 nats per token. `declared_problems`
checks a recipe's gates against what it measures before any work; `check` judges each variant's
row; a gate whose figure was not measured fails. A failed gate is one of the report's problems
and makes `workbench run` exit `GATE_FAILED`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from evals.settings import Evals
from reports.metrics import AGREE, KL, RECOVERY, VARIANT, Family

GATE_FAILED = 3
"""`workbench run`'s exit code when every measurement ran but a gate failed (1: a request
failed or the server check disagreed; 2: the recipe or the run could not start)."""


@dataclass(frozen=True)
class GateKind:
    family: Family
    bound: Literal["at least", "at most"]
    scale: float
    """Row value = threshold x scale (recovery rows are in percent, thresholds fractions)."""
    names: Callable[[Evals], list[str]]
    """What the recipe measures under this kind: the names its gates may bound."""
    what: str


def _tasks(evals: Evals) -> list[str]:
    return evals.task_names()


def _divergence_data(evals: Evals) -> list[str]:
    return list(evals.divergence.data) if evals.divergence else []


GATE_KINDS: dict[str, GateKind] = {
    "recovery": GateKind(RECOVERY, "at least", 100.0, _tasks, "evals.quality task"),
    "max_kl": GateKind(KL, "at most", 1.0, _divergence_data, "evals.divergence data set"),
    "min_top1_agreement": GateKind(
        AGREE, "at least", 1.0, _divergence_data, "evals.divergence data set"
    ),
}

Gates = dict[str, dict[str, float]]
"""{gate kind: {task or data set: threshold}}, as the recipe writes it."""


def declared_problems(gates: Gates, evals: Evals) -> list[str]:
    """Each gate the recipe cannot have measured: an unknown kind, or a name its evals do not
    measure; each line names the key (`kind.name`, under `gates`) and the known ones."""
    out = []
    for kind, bounds in gates.items():
        gate = GATE_KINDS.get(kind)
        if gate is None:
            out.append(f"{kind}: unknown gate kind; known: {', '.join(GATE_KINDS)}")
            continue
        known = gate.names(evals)
        for name in bounds:
            if name not in known:
                out.append(
                    f"{kind}.{name}: {name!r} is not an {gate.what} of this recipe; known: "
                    f"{', '.join(known) or f'none (the recipe has no {gate.what})'}"
                )
    return out


@dataclass(frozen=True)
class GateResult:
    variant: str
    gate: str
    """`recovery.hellaswag`: the kind and the name bounded."""
    bound: str
    threshold: float
    measured: float | None
    """In the threshold's units; None: not measured."""
    passed: bool

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "gate": self.gate, "bound": self.bound,
                "threshold": self.threshold, "measured": self.measured, "passed": self.passed}  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> GateResult:
        return cls(doc["variant"], doc["gate"], doc["bound"], doc["threshold"], doc["measured"],
                   doc["passed"])  # fmt: skip

    def problem(self) -> str:
        found = "not measured" if self.measured is None else f"measured {self.measured:.4g}"
        return f"{self.variant}: gate {self.gate} ({self.bound} {self.threshold:g}) failed: {found}"


def check(gates: Gates, rows: list[dict[str, Any]], reference: str | None) -> list[GateResult]:
    """Every gate on every variant's row but the reference's (`rows`: name under `variant`)."""
    out = []
    for kind, bounds in gates.items():
        gate = GATE_KINDS[kind]
        for name, threshold in bounds.items():
            for row in rows:
                if row[VARIANT.key] == reference:
                    continue
                value = row.get(gate.family.key(name))
                measured = None if value is None else value / gate.scale
                passed = measured is not None and (
                    measured >= threshold if gate.bound == "at least" else measured <= threshold
                )
                out.append(GateResult(row[VARIANT.key], f"{kind}.{name}", gate.bound, threshold,
                                      measured, passed))  # fmt: skip
    return out


def exit_code(problems: list[str], gates: list[GateResult]) -> int:
    """0 when nothing went wrong; `GATE_FAILED` when only gates failed; 1 otherwise."""
    failed = sum(not g.passed for g in gates)
    if len(problems) > failed:
        return 1
    return GATE_FAILED if failed else 0
