"""Measure every built variant for the report: quality with lm-eval, serving under load.

Model: each measurement is a JSON file in `<work dir>/evals/<variant>/` that records the key it
was made under: a hash of the variant's artifact hash, the measurement's settings and
`EVALS_VERSION`. A file whose key matches is reused, so rerunning an unchanged recipe measures
nothing; `force` measures again. Files are written whole (temp file + rename).

Load is measured over HTTP against `workbench serve` in a subprocess, one server per model; an
adapter variant is measured on its base's server, hot-loaded over HTTP (`/v1/load_lora_adapter`),
benchmarked under its own name and unloaded before the next one is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.artifact import artifact_from_manifest
from workbench.pipeline import VariantResult
from workbench.recipe import LoadEval, Recipe

EVALS_VERSION = 4
"""Bump when what a measurement computes changes, so stale results are not reused."""
MAX_DEFAULT_LENGTH = 2048


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([EVALS_VERSION, *parts], sort_keys=True).encode()).hexdigest()[
        :16
    ]


def lookup(path: Path, key: str) -> dict[str, Any] | None:
    """The result stored at `path` under `key`, if any."""
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return stored["result"]
    return None


def store(path: Path, key: str, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "result": result}, indent=2))
    tmp.replace(path)


def cached(
    path: Path, key: str, force: bool, compute: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any], bool]:
    """(result, reused): the stored result when its key matches, else `compute()` stored."""
    stored = None if force else lookup(path, key)
    if stored is not None:
        return stored, True
    result = compute()
    store(path, key, result)
    return result, False


def eval_max_length(recipe: Recipe, variant: VariantResult) -> int:
    if recipe.evals.max_length:
        return recipe.evals.max_length
    from transformers import AutoConfig

    artifact = artifact_from_manifest(variant.path)
    source = artifact.base if artifact.kind == "adapter" and artifact.base else variant.path
    config = AutoConfig.from_pretrained(source)
    return min(
        int(getattr(config, "max_position_embeddings", 0) or 0) or MAX_DEFAULT_LENGTH,
        MAX_DEFAULT_LENGTH,
    )


def _load_model(variant: VariantResult, dtype: str = "float32") -> tuple[Any, Any]:
    import torch
    from transformers import AutoTokenizer

    from workbench.artifact_eval import load_for_eval

    artifact = artifact_from_manifest(variant.path)
    model = load_for_eval(artifact, getattr(torch, dtype))
    return model, AutoTokenizer.from_pretrained(variant.path)


def measure_quality(recipe: Recipe, variant: VariantResult) -> dict[str, Any]:
    from lm_eval import __version__ as lm_eval_version

    from evals.quality import evaluate_model, summarize

    started = time.perf_counter()
    evals = recipe.evals
    model, tokenizer = _load_model(variant, evals.dtype)
    max_length = eval_max_length(recipe, variant)
    results = evaluate_model(
        model, tokenizer, evals.task_requests(), max_length, batch_size=evals.batch_size
    )
    return {
        "tasks": summarize(results, evals.task_names(), results["workbench_sources"]),
        "max_length": max_length,
        "dtype": evals.dtype,
        "lm_eval_version": lm_eval_version,
        "seconds": round(time.perf_counter() - started, 2),
    }


def quality(
    recipe: Recipe, variant: VariantResult, work_dir: Path, force: bool
) -> tuple[dict[str, Any], bool]:
    key = _key(variant.manifest["hash"], recipe.evals.quality_key(), recipe.evals.max_length)
    path = work_dir / "evals" / variant.name / "quality.json"
    return cached(path, key, force, lambda: measure_quality(recipe, variant))


def measure_divergence(
    recipe: Recipe, variant: VariantResult, reference: VariantResult
) -> dict[str, Any]:
    """{data set: KL / agreement / perplexity stats} of `variant` against `reference`."""
    from compress.data import load_texts, token_rows
    from evals.divergence import divergence

    settings = recipe.evals.divergence
    assert settings is not None
    started = time.perf_counter()
    model, tokenizer = _load_model(variant, settings.dtype)
    same = variant.name == reference.name
    ref_model = model if same else _load_model(reference, settings.dtype)[0]
    out: dict[str, Any] = {"reference": reference.name, "dtype": settings.dtype, "data": {}}
    for name in settings.data:
        rows = token_rows(tokenizer, load_texts(name, "validation"), settings.seq_len)
        rows = rows[: settings.windows]
        scored = sum(len(tokenizer.decode(r[1:]).encode()) for r in rows.tolist())
        out["data"][name] = divergence(ref_model, model, rows, scored)
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def divergence_result(
    recipe: Recipe,
    variant: VariantResult,
    results: list[VariantResult],
    work_dir: Path,
    force: bool,
) -> tuple[dict[str, Any] | None, bool]:
    """(stats against the recipe's reference variant, reused); the reference against itself
    gives its own perplexity and bits per byte. (None, False) when there is no divergence eval,
    or `--variant` left the reference out of this run."""
    settings = recipe.evals.divergence
    reference = next((r for r in results if settings and r.name == settings.reference), None)
    if settings is None or reference is None:
        return None, False
    key = _key(
        variant.manifest["hash"],
        reference.manifest["hash"],
        settings.model_dump(mode="json"),
    )
    path = work_dir / "evals" / variant.name / "divergence.json"
    return cached(path, key, force, lambda: measure_divergence(recipe, variant, reference))


@dataclass
class ServerSession:
    """One server: a model variant (or an adapter's base that is no variant) and the adapters
    measured on it."""

    model_path: Path
    model_variant: VariantResult | None
    adapters: list[VariantResult] = field(default_factory=list)


def server_sessions(results: list[VariantResult]) -> list[ServerSession]:
    sessions: dict[Path, ServerSession] = {}
    for r in results:
        if r.manifest.get("kind") != "adapter":
            sessions.setdefault(r.path.resolve(), ServerSession(r.path, r))
    for r in results:
        if r.manifest.get("kind") == "adapter":
            base = artifact_from_manifest(r.path).base
            assert base is not None, f"{r.path}: an adapter's manifest names its base"
            session = sessions.setdefault(base.resolve(), ServerSession(base, None))
            session.adapters.append(r)
    return list(sessions.values())


def _adapter_rank(path: Path) -> int:
    config = json.loads((path / "adapter_config.json").read_text())
    return max(
        [int(config.get("r", 8)), *(int(v) for v in (config.get("rank_pattern") or {}).values())]
    )


def serve_flags(recipe: Recipe, session: ServerSession) -> list[str]:
    """The server's flags: the recipe's KV budget, a running cap above the ramp, and a context
    long enough for the ramp's requests and the server check's windows (lm-eval's + 2)."""
    load = recipe.evals.load
    assert load is not None
    flags = ["--max-num-seqs", str(load.max_num_seqs)]
    if load.kv_cache_memory:
        flags += ["--kv-cache-memory", load.kv_cache_memory]
    longest = max(load.prompt_len) + load.max_tokens
    if session.model_variant is not None and recipe.evals.quality:
        longest = max(longest, eval_max_length(recipe, session.model_variant) + 2)
    if recipe.evals.chat_prompts:
        longest = max(longest, _chat_length(recipe, session.model_path))
    flags += ["--max-model-len", str(longest)]
    if session.adapters:
        rank = max(_adapter_rank(a.path) for a in session.adapters)
        roots = {a.path.resolve().parent for a in session.adapters}
        root = roots.pop() if len(roots) == 1 else Path(os.path.commonpath(roots))
        flags += ["--max-loras", "1", "--max-lora-rank", str(rank), "--lora-root", str(root)]
    return flags


def _chat_length(recipe: Recipe, model_path: Path) -> int:
    """Tokens the longest chat prompt (template applied) and its answer take."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    lengths = []
    for p in recipe.evals.chat_prompts:
        encoded: Any = tok.apply_chat_template(  # return_dict: a mapping with input_ids
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
        )
        lengths.append(len(encoded["input_ids"]))
    return max(lengths) + recipe.evals.chat_max_tokens


def load_key(load: LoadEval, variant: VariantResult) -> str:
    return _key(variant.manifest["hash"], load.model_dump(mode="json"))


def _sweep(url: str, load: LoadEval, model: str) -> dict[str, Any]:
    from evals.load import sweep

    return sweep(
        url,
        load.concurrency,
        load.prompt_len,
        load.max_tokens,
        load.requests_per_point,
        model,
        load.requests_per_client,
    )


def _post(url: str, route: str, body: dict[str, Any]) -> None:
    import httpx

    r = httpx.post(f"{url}{route}", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{route} {body}: HTTP {r.status_code}: {r.text[:300]}")


def adapter_requests(url: str, adapter: str) -> float:
    """Requests the server has run with `adapter`, from its `workbench:lora_requests` counter."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "workbench:lora_requests_total" and sample.labels["adapter"] == adapter
    )


def run_session(
    recipe: Recipe,
    session: ServerSession,
    work_dir: Path,
    force: bool,
    check: Callable[[str, str], None] | None = None,
    answers: dict[str, list[dict[str, Any]]] | None = None,
) -> dict[str, tuple[dict[str, Any], bool]]:
    """Load results of the session's variants, {name: (result, reused)}; starts the server only
    when something must be measured. `check(url, served name)` runs once the server is up; each
    variant's chat answers (the recipe's `chat_prompts`) go into `answers`."""
    from evals.load_cli import served

    load = recipe.evals.load
    assert load is not None
    members = ([session.model_variant] if session.model_variant else []) + session.adapters
    paths = {m.name: work_dir / "evals" / m.name / "load.json" for m in members}
    out: dict[str, tuple[dict[str, Any], bool]] = {}
    pending: list = []
    chats: dict[str, list[dict[str, Any]] | None] = {}
    for m in members:
        stored = None if force else lookup(paths[m.name], load_key(load, m))
        if stored is not None:
            out[m.name] = (stored, True)
        else:
            pending.append(m)
        chats[m.name] = stored_chat = _stored_answers(recipe, m, work_dir, force)
        if answers is not None and stored_chat is not None:
            answers[m.name] = stored_chat
    asked = [m for m in members if chats[m.name] is None and recipe.evals.chat_prompts]
    if not pending and not asked and check is None:
        return out
    if session.model_variant is not None:
        name, log_name = session.model_variant.name, session.model_variant.name
    else:  # a base that is no variant of the recipe, serving only adapters
        name, log_name = "adapter-base", f"{session.adapters[0].name}-base"
    flags = ["--served-model-name", name, *serve_flags(recipe, session)]
    log = work_dir / "evals" / f"server-{log_name}.log"
    with served(str(session.model_path), flags, log) as url:
        if check is not None:
            check(url, name)
        for m in [m for m in members if m in pending or m in asked]:
            is_adapter = m is not session.model_variant
            if is_adapter:
                _post(
                    url,
                    "/v1/load_lora_adapter",
                    {"lora_name": m.name, "lora_path": str(m.path.resolve())},
                )
            if m in asked:
                chat = _ask(recipe, url, m, work_dir)
                if answers is not None:
                    answers[m.name] = chat
            if m in pending:
                result = _sweep(url, load, m.name)
                if is_adapter:  # proof that the hot-loaded adapter, not the base, ran them
                    result["adapter_requests"] = adapter_requests(url, m.name)
                store(paths[m.name], load_key(load, m), result)
                out[m.name] = (result, False)
            if is_adapter:
                with contextlib.suppress(RuntimeError):
                    _post(url, "/v1/unload_lora_adapter", {"lora_name": m.name})
    return out


def _answers_key(recipe: Recipe, variant: VariantResult) -> str:
    return _key(variant.manifest["hash"], recipe.evals.chat_prompts, recipe.evals.chat_max_tokens)


def _answers_path(work_dir: Path, variant: VariantResult) -> Path:
    return work_dir / "evals" / variant.name / "answers.json"


def _stored_answers(
    recipe: Recipe, variant: VariantResult, work_dir: Path, force: bool
) -> list[dict[str, Any]] | None:
    stored = (
        None if force else lookup(_answers_path(work_dir, variant), _answers_key(recipe, variant))
    )
    return stored["answers"] if stored is not None else None


def _ask(recipe: Recipe, url: str, variant: VariantResult, work_dir: Path) -> list[dict[str, Any]]:
    from evals.chat_answers import chat_answers

    evals = recipe.evals
    chat = chat_answers(url, variant.name, evals.chat_prompts, evals.chat_max_tokens)
    store(_answers_path(work_dir, variant), _answers_key(recipe, variant), {"answers": chat})
    return chat


@dataclass
class Measurements:
    quality: dict[str, dict[str, Any]] = field(default_factory=dict)
    load: dict[str, dict[str, Any]] = field(default_factory=dict)
    server_check: dict[str, Any] | None = None
    answers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """{variant: greedy chat answers}, in the recipe's prompt order."""
    reused: list[str] = field(default_factory=list)
    """`variant/quality` or `variant/load` for every result taken from an earlier run."""


def _server_check(
    recipe: Recipe, variant: VariantResult, work_dir: Path, force: bool, out: Measurements
) -> Callable[[str, str], None] | None:
    """The check to run on `variant`'s server, or None when a stored one is still valid."""
    from evals.server_check import check_server

    docs = recipe.evals.server_check_docs
    if not recipe.evals.quality or docs == 0:
        return None
    key = _key(variant.manifest["hash"], recipe.evals.quality_key(), recipe.evals.max_length, docs)
    path = work_dir / "evals" / variant.name / "server_check.json"
    stored = None if force else lookup(path, key)
    if stored is not None:
        out.server_check = stored
        out.reused.append(f"{variant.name}/server_check")
        return None

    def check(url: str, name: str) -> None:
        model, tokenizer = _load_model(variant)
        tasks, max_length = recipe.evals.task_requests(), eval_max_length(recipe, variant)
        result = check_server(
            url, name, model, tokenizer, str(variant.path), tasks, max_length, docs
        )
        result |= {"variant": variant.name, "documents_per_task": docs}
        store(path, key, result)
        out.server_check = result

    return check


def measure_variants(
    recipe: Recipe,
    results: list[VariantResult],
    work_dir: Path,
    force: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Measurements:
    out = Measurements()
    for r in results:
        if recipe.evals.quality:
            out.quality[r.name], reused = quality(recipe, r, work_dir, force)
            progress(f"quality {r.name}: {'reused' if reused else 'measured'}")
            if reused:
                out.reused.append(f"{r.name}/quality")
        div, reused = divergence_result(recipe, r, results, work_dir, force)
        if div is None and recipe.evals.divergence is not None:
            ref = recipe.evals.divergence.reference
            progress(f"divergence {r.name}: skipped, {ref!r} is not in this run (--variant {ref})")
        if div is not None:
            out.quality[r.name] = {**out.quality.get(r.name, {}), "divergence": div}
            progress(f"divergence {r.name}: {'reused' if reused else 'measured'}")
            if reused:
                out.reused.append(f"{r.name}/divergence")
    if recipe.evals.load is None:
        return out
    checked = False
    for session in server_sessions(results):
        check = None
        if session.model_variant is not None and not checked:
            check = _server_check(recipe, session.model_variant, work_dir, force, out)
            checked = True
        sessions = run_session(recipe, session, work_dir, force, check, out.answers)
        for name, (result, reused) in sessions.items():
            out.load[name] = result
            progress(f"load {name}: {'reused' if reused else 'measured'}")
            if reused:
                out.reused.append(f"{name}/load")
    return out
