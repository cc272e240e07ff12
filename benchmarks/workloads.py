"""The engine benchmarks' request sets: random prompt tokens of given lengths, each request asking
for an exact number of output tokens (end-of-sequence ignored).

`mixed` (prompts 16-512, outputs 16-256) and `equal` (their means) are `bench-engine`'s own; the
engine-speed issue's are `mixed-256` (prompts 16-256, outputs 16-128), `uniform` (128 + 64),
`prefill-bound` (256 + 1: throughput counts prompt and output tokens) and `decode-bound` (16 + 128).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def counted_tokens(self) -> int:
        """The tokens throughput counts: output, or prompt + output for a prefill-bound load."""
        if self.name == "prefill-bound":
            return self.output_tokens + sum(map(len, self.prompts))
        return self.output_tokens


FIXED_WORKLOADS = {
    "equal": (264, 136),
    "uniform": (128, 64),
    "prefill-bound": (256, 1),
    "decode-bound": (16, 128),
}
MIXED_WORKLOADS = {"mixed": ((16, 512), (16, 256)), "mixed-256": ((16, 256), (16, 128))}


def make_workload(kind: str, n: int, vocab: int, seed: int = 0) -> Workload:
    """`n` requests of random prompt tokens: lengths uniform in a mixed workload's ranges, or a
    fixed workload's (prompt, output) lengths."""
    rng = random.Random(seed)
    if kind in MIXED_WORKLOADS:
        (p0, p1), (o0, o1) = MIXED_WORKLOADS[kind]
        lengths = [(rng.randint(p0, p1), rng.randint(o0, o1)) for _ in range(n)]
    elif kind in FIXED_WORKLOADS:
        lengths = [FIXED_WORKLOADS[kind]] * n
    else:
        known = ", ".join([*MIXED_WORKLOADS, *FIXED_WORKLOADS])
        raise ValueError(f"unknown workload {kind!r}; use one of {known}")
    prompts = [[rng.randrange(10, vocab) for _ in range(p)] for p, _ in lengths]
    return Workload(kind, prompts, [o for _, o in lengths])
