"""Prefill time of the engine per N prompt tokens, against SDPA fed 3-D tensors (the baseline).

`python -m benchmarks.prefill_bench [--model DIR] [--tokens 1024] [--rounds 6]`: one request of N
tokens and one output token, run whole in one step (no prefix cache), alternating round by round
between the engine's `SDPABackend` (4-D inputs: SDPA's fused CPU kernel) and the same backend
with 3-D inputs (where SDPA falls back to its math path). Reports the median and range of each
and the median of the per-round ratios; the first round is warm-up. Default model: the ~25M
random Llama of `workbench bench-engine` (hidden 512, 8 layers, GQA 8/4).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from serve.core.config import SchedulerConfig
from serve.core.sampling_params import SamplingParams
from serve.engine.llm import LLM
from serve.model import attention, sdpa_attention


class ThreeDPrefill(sdpa_attention.SDPABackend):
    """The baseline: prefill chunks passed to SDPA as [heads, n, head_dim]."""

    def attend(self, q, k_cache, v_cache, meta, scale, window=None):
        assert window is None, "the 3-D prefill baseline has no sliding window"
        out = super().attend(q, k_cache, v_cache, _decodes_only(meta), scale)
        for s in meta.prefills:
            k = sdpa_attention.gather(k_cache, s.block_ids, s.seq_len).transpose(0, 1)
            v = sdpa_attention.gather(v_cache, s.block_ids, s.seq_len).transpose(0, 1)
            qp = q[s.start : s.end].transpose(0, 1)
            n = s.end - s.start
            mask = None if n == s.seq_len else sdpa_attention._causal_mask(n, s.seq_len, q.device)
            o = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            out[s.start : s.end] = o.transpose(0, 1)
        return out


def _decodes_only(meta: attention.AttentionMetadata) -> attention.AttentionMetadata:
    return dataclasses.replace(meta, prefills=[])


def prefill_seconds(llm: LLM, backend: sdpa_attention.SDPABackend, tokens: int) -> float:
    llm.engine.runner.backend = backend
    prompt = [[(i * 7919) % 4000 + 10 for i in range(tokens)]]
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="model dir (default: the 25M random Llama)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    if args.model is None:
        from benchmarks.bench_models import default_llama_25m

        args.model = default_llama_25m()
    llm = LLM(
        args.model,
        device="cpu",
        dtype="float32",
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.tokens,
            max_model_len=args.tokens + 1,
            enable_prefix_caching=False,
        ),
    )
    systems = {
        "engine (4-D SDPA)": sdpa_attention.SDPABackend(),
        "baseline (3-D SDPA)": ThreeDPrefill(),
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for name, backend in systems.items():
                seconds = prefill_seconds(llm, backend, args.tokens)
                if r:
                    times[name].append(seconds)
    for name, values in times.items():
        print(
            f"{name}: prefill of {args.tokens} tokens {statistics.median(values) * 1000:.0f} ms "
            f"(min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f})"
        )
    ratios = [b / e for e, b in zip(*times.values())]
    print(
        f"baseline / engine: x{statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {args.rounds} rounds"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
