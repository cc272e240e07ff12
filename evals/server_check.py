"""Does lm-eval scored through our HTTP server agree with lm-eval scored in-process?

Model: the same tasks and documents go through lm-eval twice, once with `HFLM` over the model in
memory and once with lm-eval's `local-completions` model against `/v1/completions` (token-id
prompts, `echo` + `logprobs`, one generated token that lm-eval drops). Every request's
loglikelihood must agree within `ABS_TOL + REL_TOL * |loglikelihood|` and the greedy flags must
be equal. The window sizes line up when the API model's `max_length` is HFLM's plus 2: lm-eval
keeps one token for the generated one and scores rolling windows one token shorter than that.
"""

from __future__ import annotations

from typing import Any

from evals.quality import TaskRequest, evaluate_model, run_tasks

ABS_TOL = 1e-3
"""Nats per request: float32 on both sides, different kernels (paged attention vs SDPA)."""
REL_TOL = 1e-6


def server_results(
    url: str,
    model_name: str,
    tokenizer_dir: str,
    tasks: list[TaskRequest],
    max_length: int,
    limit: int,
) -> dict[str, Any]:
    model_args = {
        "model": model_name,
        "base_url": f"{url}/v1/completions",
        "tokenizer": tokenizer_dir,
        "tokenizer_backend": "huggingface",
        "add_bos_token": True,  # as HFLM, which keeps the tokenizer's special tokens
        "max_length": max_length + 2,
        "num_concurrent": 4,
        "max_retries": 1,
    }
    return run_tasks("local-completions", model_args, tasks, limit, log_samples=True)


def _pairs(response: Any) -> list[tuple[float, bool | None]]:
    """A sample's filtered responses as (loglikelihood, is_greedy) pairs."""
    out: list[tuple[float, bool | None]] = []
    for r in response:
        if isinstance(r, list | tuple):
            out.append((float(r[0]), bool(r[1])))
        else:
            out.append((float(r), None))
    return out


def compare(local: dict[str, Any], remote: dict[str, Any]) -> dict[str, Any]:
    """Per (leaf) task: requests compared, the largest absolute and relative difference, and whether
    every request is within tolerance with the same greedy flag."""
    report: dict[str, Any] = {"abs_tol": ABS_TOL, "rel_tol": REL_TOL, "tasks": {}}
    for task in sorted(local["samples"]):
        a = {s["doc_id"]: _pairs(s["filtered_resps"]) for s in local["samples"][task]}
        b = {s["doc_id"]: _pairs(s["filtered_resps"]) for s in remote["samples"][task]}
        if a.keys() != b.keys():
            raise ValueError(f"{task}: the two runs scored different documents")
        worst_abs = worst_rel = 0.0
        ok, n = True, 0
        for doc_id, pairs in a.items():
            for (x, gx), (y, gy) in zip(pairs, b[doc_id], strict=True):
                diff = abs(x - y)
                worst_abs = max(worst_abs, diff)
                worst_rel = max(worst_rel, diff / max(abs(x), 1e-12))
                ok &= diff <= ABS_TOL + REL_TOL * abs(x) and gx == gy
                n += 1
        report["tasks"][task] = {
            "requests": n,
            "max_abs_diff": worst_abs,
            "max_rel_diff": worst_rel,
            "ok": ok,
        }
    report["ok"] = all(t["ok"] for t in report["tasks"].values())
    return report


def check_server(
    url: str,
    model_name: str,
    model: Any,
    tokenizer: Any,
    tokenizer_dir: str,
    tasks: list[TaskRequest],
    max_length: int,
    limit: int = 8,
) -> dict[str, Any]:
    """Both runs over the first `limit` documents of each task, compared."""
    local = evaluate_model(model, tokenizer, tasks, max_length, limit=limit, log_samples=True)
    remote = server_results(url, model_name, tokenizer_dir, tasks, max_length, limit)
    return compare(local, remote)
