"""vLLM's offline engine as a benchmark system, run by the *vLLM venv's* Python (it imports only
vLLM and the standard library; the workbench is not installed there).

`VENV/bin/python benchmarks/vllm_worker.py --model DIR [--dtype float32] [--max-model-len 2048]
[--max-num-seqs N] [--max-num-batched-tokens N] [--enable-prefix-caching] [--profile-dir DIR]
[--enforce-eager]`

Protocol, one JSON object per line: after start-up the worker writes
`{"ready": true, "version": ..., "config": {...}}`; then for each request line
`{"prompts": [[ids]], "max_tokens": [n]}` it generates greedily exactly `n` tokens per prompt
(end-of-sequence ignored) in one `LLM.generate` call and answers
`{"seconds": wall seconds of that call, "outputs": [[ids]]}` (with `"logprobs": true` in the
request, also `"logprobs": [[the chosen token's logprob at each step]]`; with `"profile": true`
in the request and `--profile-dir`, that call runs under vLLM's torch profiler, whose traces
land in the directory); a line `{"score": [[ids]]}` is answered `{"nll": [per window: mean NLL
in nats of tokens 2..], "top1": [per window: the most likely token at positions 1..]}` (prompt
logprobs, one call); an empty line or end of input stops it. Everything vLLM prints goes to
stderr: stdout carries the protocol only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO


def _protocol_stream() -> TextIO:
    """The original stdout for the protocol; fd 1 (and every child's) then points at stderr."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return stream


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--profile-dir", help="vLLM's torch profiler writes its traces here")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    args = parser.parse_args()
    out = _protocol_stream()

    import vllm
    from vllm import LLM

    options = _options(args)
    llm = LLM(**options)
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    config = {
        **options,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    out.write(json.dumps({"ready": True, "version": vllm.__version__, "config": config}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        answer: dict[str, Any]
        if "score" in job:
            answer = _score(llm, job["score"])
        else:
            answer = _generate(
                llm, job, profiled=bool(job.get("profile")) and bool(args.profile_dir)
            )
        out.write(json.dumps(answer) + "\n")
    return 0


def _options(args: argparse.Namespace) -> dict[str, object]:
    """The `vllm.LLM` arguments the flags ask for."""
    options: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "seed": 0,
    }
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.profile_dir:
        options["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": args.profile_dir,
            "torch_profiler_with_stack": False,
            "torch_profiler_record_shapes": True,  # linears by input shape (op_profile)
            "torch_profiler_use_gzip": False,
        }
    return options


def _generate(llm: Any, job: dict[str, Any], profiled: bool) -> dict[str, object]:
    """One batch of greedy generations of exactly `max_tokens` each: seconds and token ids
    (and the chosen tokens' logprobs when asked)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    want_logprobs = bool(job.get("logprobs"))
    params = [
        SamplingParams(
            max_tokens=n,
            min_tokens=n,
            temperature=0.0,
            ignore_eos=True,
            logprobs=0 if want_logprobs else None,
        )
        for n in job["max_tokens"]
    ]
    if profiled:
        llm.start_profile()
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if profiled:
        llm.stop_profile()
    outputs = [list(r.outputs[0].token_ids) for r in results]
    answer: dict[str, object] = {"seconds": seconds, "outputs": outputs}
    if want_logprobs:  # the chosen token's logprob at each step
        answer["logprobs"] = [
            [step[t].logprob for step, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)]
            for r in results
        ]
    return answer


def _score(llm: object, windows: list[list[int]]) -> dict[str, list]:
    """Per window: the mean negative log-likelihood (nats) of tokens 2.. given those before, and
    the most likely token at each position (vLLM's prompt logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    results = llm.generate(  # type: ignore[attr-defined]
        [TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False
    )
    nll, top1 = [], []
    for ids, r in zip(windows, results):
        positions = r.prompt_logprobs[1:]  # the first token has no prediction
        nll.append(-sum(p[t].logprob for p, t in zip(positions, ids[1:])) / (len(ids) - 1))
        top1.append([next(t for t, lp in p.items() if lp.rank == 1) for p in positions])
    return {"nll": nll, "top1": top1}


if __name__ == "__main__":
    raise SystemExit(main())
