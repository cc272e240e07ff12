"""Structured-output cost: what a grammar costs per step, and what free requests in the same
batch pay for it.

`python -m benchmarks.grammar_bench [--model DIR] [--requests 16] [--constrained 16] [--rounds 3]
[--schema plain|bounded]`: in one engine, alternating round by round, runs
  (a) `--requests` free greedy requests beside `--constrained` JSON-schema-constrained ones, and
  (b) the same free requests beside as many unconstrained twins of the constrained ones (same
      prompts, same output lengths: the lengths the constrained ones reach),
so both batches have the same shape and differ only in the grammar. Prints per round the free
requests' mean time per output token in (a) and (b) and their ratio, the engine's time per step
in (a) and (b) (its phase timings summed: less noisy than the requests' times), the time spent in
the grammar engine per step of (a): token masks and token consumption, and how many masks
were deferred (greedy xgrammar rows: the free argmax offered first) and how many of those the
grammar rejected. `--schema plain` is enforced by xgrammar, `bounded` (string lengths) by
llguidance (`serve/model/grammar_engines.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from catalog import ensure_demo_model
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.core.sampling_params import Grammar, SamplingParams
from serve.engine.llm_engine import LLMEngine
from serve.model.grammar_engines import route

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SCHEMAS = {  # plain: xgrammar enforces it; bounded (string lengths): llguidance
    "plain": {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string"}}},
    "bounded": SCHEMA,
}


class GrammarClock:
    """Wraps the engine's grammar backend calls and adds up their time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        grammars = engine.grammars
        grammars._masks = self._timed(grammars._masks)  # type: ignore[method-assign]
        grammars.consume = self._timed(grammars.consume)  # type: ignore[method-assign]

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run_batch(
    engine: LLMEngine, batch: list[tuple[str, list[int], SamplingParams]]
) -> tuple[dict[str, float], dict[str, int], int, float]:
    """Runs the batch to the end: (seconds per output token of each request, output lengths,
    steps, the engine's phase timings summed per step in seconds)."""
    engine_seconds = sum(engine.timings.values())
    for request_id, prompt, params in batch:
        engine.add_request(request_id, prompt, params)
    first_token: dict[str, float] = {}
    done: dict[str, float] = {}
    lengths: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for rid in engine.progress:
            first_token.setdefault(rid, now)
        for out in outputs:
            if out.finished:
                done[out.request_id] = now
                lengths[out.request_id] = out.num_output_tokens
    per_token = {rid: (done[rid] - first_token[rid]) / max(1, lengths[rid] - 1) for rid in done}
    return per_token, lengths, steps, (sum(engine.timings.values()) - engine_seconds) / steps


Batch = list[tuple[str, list[int], SamplingParams]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="model dir (default: the tiny demo model)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--constrained", type=int, default=16)
    parser.add_argument("--free-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="plain")
    args = parser.parse_args(argv)
    args.model = args.model or ensure_demo_model("demo-tiny")
    engine = LLMEngine(
        ModelConfig(str(args.model), dtype="float32", device="cpu"),
        CacheConfig(num_blocks=2048, block_size=16),
        SchedulerConfig(max_num_seqs=args.requests + args.constrained),
    )
    tok = engine.tokenizer
    free = [
        (
            f"free-{i}",
            tok(f"Item {i}: the river").input_ids,
            SamplingParams(max_tokens=args.free_tokens, temperature=0, ignore_eos=True),
        )
        for i in range(args.requests)
    ]
    grammar = Grammar("json_schema", json.dumps(SCHEMAS[args.schema]))
    constrained_prompts = [tok(f"Person {i} as JSON:").input_ids for i in range(args.constrained)]
    constrained = [
        (f"json-{i}", p, SamplingParams(max_tokens=200, temperature=0, grammar=grammar))
        for i, p in enumerate(constrained_prompts)
    ]
    # warm-up: the grammar engine's tokenizer, kernels
    run_batch(engine, free[:1] + constrained[:1])
    # the twins' lengths: what the constrained requests reach (greedy: the same every round)
    _, lengths, _, _ = run_batch(engine, free + constrained)
    twins = [
        (
            f"twin-{i}",
            p,
            SamplingParams(max_tokens=lengths[f"json-{i}"], temperature=0, ignore_eos=True),
        )
        for i, p in enumerate(constrained_prompts)
    ]
    clock, name = GrammarClock(engine), route(grammar).engine
    rounds = [_round(engine, clock, free, constrained, twins, r, name) for r in range(args.rounds)]
    ratios, step_ratios = [r for r, _ in rounds], [s for _, s in rounds]
    print(
        f"medians over {args.rounds} rounds: free requests {statistics.median(ratios):.3f}x "
        f"({min(ratios):.3f}-{max(ratios):.3f}), engine step {statistics.median(step_ratios):.3f}x "
        f"({min(step_ratios):.3f}-{max(step_ratios):.3f})"
    )
    return 0


def _round(
    engine: LLMEngine,
    clock: GrammarClock,
    free: Batch,
    constrained: Batch,
    twins: Batch,
    r: int,
    engine_name: str,
) -> tuple[float, float]:
    """One round: the free requests beside constrained ones and beside their unconstrained
    twins (which runs first alternates); the per-token and per-step ratios."""
    if r % 2:
        without, _, _, step_without = run_batch(engine, free + twins)
    clock.seconds = 0.0
    engine.grammars.counts.update(dict.fromkeys(engine.grammars.counts, 0))
    with_grammar, lengths_now, steps, step_with = run_batch(engine, free + constrained)
    grammar_s = clock.seconds
    counts = dict(engine.grammars.counts)
    if not r % 2:
        without, _, _, step_without = run_batch(engine, free + twins)
    a = statistics.mean(with_grammar[rid] for rid, _, _ in free)
    b = statistics.mean(without[rid] for rid, _, _ in free)
    print(
        f"round {r + 1}: free requests {a * 1000:.2f} ms/token beside constrained ones, "
        f"{b * 1000:.2f} beside unconstrained twins: {a / b:.3f}x; engine step "
        f"{step_with * 1000:.3f} / {step_without * 1000:.3f} ms: "
        f"{step_with / step_without:.3f}x; {engine_name} "
        f"{grammar_s * 1000 / steps:.2f} ms per step ({steps} steps, "
        f"{len(constrained)} constrained requests, mean length "
        f"{statistics.mean(lengths_now[c[0]] for c in constrained):.0f} tokens); masks "
        f"computed {counts['masks']}, deferred {counts['deferred']} (rejected "
        f"{counts['rejected']})"
    )
    return a / b, step_with / step_without


if __name__ == "__main__":
    raise SystemExit(main())
