"""Serving measurements of a recipe's variants: the load benchmark, chat answers and the server
check, each against `python -m serve` in a subprocess.

Model: one server per model and `serve:` settings (a variant served with an int8 KV cache gets
a server of its own beside the plain one's); an adapter variant is measured on its base's server
(with the adapter's `serve:` settings), hot-loaded over HTTP (`/v1/load_lora_adapter`),
benchmarked under its own name and unloaded before the next one is loaded. A server starts only
when something of its session must be measured.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.artifact import artifact_from_manifest
from compress.record import Record
from evals import stored
from evals.results import ChatAnswer, LoadResult, ServerCheck
from evals.settings import Evals, LoadEval, ServeSettings
from evals.variant import VariantResult
from evals.variant_evals import Measurements, eval_max_length, load_model


@dataclass
class ServerSession:
    """One server: a model variant (or an adapter's base that is no variant) and the adapters
    measured on it."""

    model_path: Path
    model_variant: VariantResult | None
    serve: ServeSettings
    adapters: list[VariantResult] = field(default_factory=list)

    @property
    def members(self) -> list[VariantResult]:
        return ([self.model_variant] if self.model_variant else []) + self.adapters


def server_sessions(results: list[VariantResult]) -> list[ServerSession]:
    sessions: dict[tuple[Path, ServeSettings], ServerSession] = {}
    for r in results:
        if r.manifest.kind != "adapter":
            sessions.setdefault((r.path.resolve(), r.serve), ServerSession(r.path, r, r.serve))
    for r in results:
        if r.manifest.kind == "adapter":
            base = artifact_from_manifest(r.path).base
            assert base is not None, f"{r.path}: an adapter's manifest names its base"
            key = (base.resolve(), r.serve)
            session = sessions.setdefault(key, ServerSession(base, None, r.serve))
            session.adapters.append(r)
    return list(sessions.values())


def _adapter_rank(path: Path) -> int:
    config = json.loads((path / "adapter_config.json").read_text())
    return max(
        [int(config.get("r", 8)), *(int(v) for v in (config.get("rank_pattern") or {}).values())]
    )


def serve_flags(evals: Evals, session: ServerSession) -> list[str]:
    """The server's flags: the session's `serve:` settings, with a load eval its KV budget and a
    running cap above the ramp, and a context long enough for the ramp's requests, the chat
    answers and the server check's windows (lm-eval's + 2)."""
    load = evals.load
    flags = list(session.serve.flags())
    longest = 1
    if load is not None:
        flags += ["--max-num-seqs", str(load.max_num_seqs)]
        if load.kv_cache_memory:
            flags += ["--kv-cache-memory", load.kv_cache_memory]
        longest = max(load.prompt_len) + load.max_tokens
    if session.model_variant is not None and evals.quality:
        longest = max(longest, eval_max_length(evals, session.model_variant) + 2)
    if evals.chat_prompts:
        longest = max(longest, _chat_length(evals, session.model_path))
    flags += ["--max-model-len", str(longest)]
    if session.adapters:
        rank = max(_adapter_rank(a.path) for a in session.adapters)
        roots = {a.path.resolve().parent for a in session.adapters}
        root = roots.pop() if len(roots) == 1 else Path(os.path.commonpath(roots))
        flags += ["--max-loras", "1", "--max-lora-rank", str(rank), "--lora-root", str(root)]
    return flags


def _chat_length(evals: Evals, model_path: Path) -> int:
    """Tokens the longest chat prompt (template applied) and its answer take."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    lengths = []
    for p in evals.chat_prompts:
        encoded: Any = tok.apply_chat_template(  # return_dict: a mapping with input_ids
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
        )
        lengths.append(len(encoded["input_ids"]))
    return max(lengths) + evals.chat_max_tokens


def load_key(load: LoadEval, variant: VariantResult) -> str:
    """("rate-ceiling": capacities searched above the ramp's peak are measured again.)"""
    return stored.key(
        variant.manifest.hash, load.model_dump(mode="json"), "rate-ceiling", *variant.serve.key()
    )


def _sweep(url: str, load: LoadEval, model: str) -> LoadResult:
    from evals.load import sweep

    return sweep(url, load, model)


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


class StoredAnswers(Record):
    answers: list[ChatAnswer]


def _answers_key(evals: Evals, variant: VariantResult) -> str:
    return stored.key(
        variant.manifest.hash, evals.chat_prompts, evals.chat_max_tokens, *variant.serve.key()
    )


def _answers_path(work_dir: Path, variant: VariantResult) -> Path:
    return stored.result_path(work_dir, variant.name, stored.ANSWERS)


def _stored_answers(
    evals: Evals, variant: VariantResult, work_dir: Path, force: bool
) -> list[ChatAnswer] | None:
    path, key = _answers_path(work_dir, variant), _answers_key(evals, variant)
    found = None if force else stored.lookup(path, key, StoredAnswers)
    return found.answers if found is not None else None


def _ask(evals: Evals, url: str, variant: VariantResult, work_dir: Path) -> list[ChatAnswer]:
    from evals.chat_answers import chat_answers

    chat = chat_answers(url, variant.name, evals.chat_prompts, evals.chat_max_tokens)
    answers = [ChatAnswer.from_json(a) for a in chat]
    path, key = _answers_path(work_dir, variant), _answers_key(evals, variant)
    stored.store(path, key, StoredAnswers(answers=answers))
    return answers


def _stored(
    evals: Evals, session: ServerSession, work_dir: Path, force: bool, out: Measurements
) -> dict[str, str]:
    """Put the session's stored load results and chat answers into `out`; {variant: "reused"}
    for each load result found (a twin's copy is not reused: it is taken again from its
    twin's result of this run)."""
    status = {}
    for m in session.members:
        path = stored.result_path(work_dir, m.name, stored.LOAD)
        found = None
        if evals.load is not None and not force:
            found = stored.lookup(path, load_key(evals.load, m), LoadResult)
        if found is not None and found.measured_on is None:
            out.load[m.name], status[m.name] = found, "reused"
        answers = _stored_answers(evals, m, work_dir, force)
        if answers is not None:
            out.answers[m.name] = answers
    return status


Twins = dict[str, str]
"""Serving signature -> the first variant of the run with it (`evals.serving_twins`)."""


def _take_twin(
    evals: Evals,
    m: VariantResult,
    signature: str | None,
    work_dir: Path,
    status: dict[str, str],
    out: Measurements,
    twins: Twins,
) -> None:
    """Register `m` as its signature's source when it is the first with it; else, once the
    source has a result and `m` has none, give `m` that result (stored under `m`'s own key,
    `measured_on` set)."""
    if evals.load is None or signature is None:
        return
    source = twins.setdefault(signature, m.name)
    if m.name in status or source == m.name or source not in out.load:
        return
    copy = out.load[source].model_copy(update={"measured_on": source})
    stored.store(stored.result_path(work_dir, m.name, stored.LOAD), load_key(evals.load, m), copy)
    out.load[m.name], status[m.name] = copy, f"as {source} (serving twin)"


def _measure(
    evals: Evals, url: str, m: VariantResult, is_adapter: bool, work_dir: Path
) -> LoadResult:
    """`m`'s load sweep on the server at `url`, stored."""
    assert evals.load is not None
    result = _sweep(url, evals.load, m.name)
    if is_adapter:  # proof that the hot-loaded adapter, not the base, ran them
        result = result.model_copy(update={"adapter_requests": adapter_requests(url, m.name)})
    stored.store(stored.result_path(work_dir, m.name, stored.LOAD), load_key(evals.load, m), result)
    return result


def run_session(
    evals: Evals,
    session: ServerSession,
    work_dir: Path,
    force: bool,
    out: Measurements,
    check: Callable[[str, str], None] | None = None,
    twins: Twins | None = None,
) -> dict[str, str]:
    """Measures the session's variants into `out` (load results, chat answers); {variant:
    "measured", "reused" or what twin's result it took}. `check(url, served name)` runs once
    the server is up; `twins` carries serving twins across the run's sessions."""
    from evals.load_cli import served
    from evals.serving_twins import serving_signature

    twins = {} if twins is None else twins
    status = _stored(evals, session, work_dir, force, out)
    pending: list[VariantResult] = []  # load sweeps still to measure: none without a load eval
    signatures: dict[str, str | None] = {}
    if evals.load is not None:
        signatures = {m.name: serving_signature(m, session.model_path) for m in session.members}
        for m in session.members:
            _take_twin(evals, m, signatures[m.name], work_dir, status, out, twins)
        pending = [m for m in session.members if m.name not in status]
    asked = [m for m in session.members if m.name not in out.answers and evals.chat_prompts]
    if not pending and not asked and check is None:
        return status
    if session.model_variant is not None:
        name, log_name = session.model_variant.name, session.model_variant.name
    else:  # a base that is no variant of the recipe, serving only adapters
        name, log_name = "adapter-base", f"{session.adapters[0].name}-base"
    flags = ["--served-model-name", name, *serve_flags(evals, session)]
    with served(
        str(session.model_path), flags, work_dir / "evals" / f"server-{log_name}.log"
    ) as url:
        if check is not None:
            check(url, name)
        for m in [m for m in session.members if m in pending or m in asked]:
            is_adapter = m is not session.model_variant
            if is_adapter:
                body = {"lora_name": m.name, "lora_path": str(m.path.resolve())}
                _post(url, "/v1/load_lora_adapter", body)
            if m in asked:
                out.answers[m.name] = _ask(evals, url, m, work_dir)
            if m in pending:  # its twin may have been measured earlier in this session
                _take_twin(evals, m, signatures[m.name], work_dir, status, out, twins)
            if m in pending and m.name not in status:
                out.load[m.name] = _measure(evals, url, m, is_adapter, work_dir)
                status[m.name] = "measured"
            if is_adapter:
                with contextlib.suppress(RuntimeError):
                    _post(url, "/v1/unload_lora_adapter", {"lora_name": m.name})
    return status


def _server_check(
    evals: Evals, variant: VariantResult, work_dir: Path, force: bool, out: Measurements
) -> Callable[[str, str], None] | None:
    """The check to run on `variant`'s server, or None when a stored one is still valid."""
    from evals.server_check import check_server

    docs = evals.server_check_docs
    if not evals.quality or docs == 0:
        return None
    key = stored.key(
        variant.manifest.hash, evals.quality_key(), evals.max_length, docs, *variant.serve.key()
    )
    path = stored.result_path(work_dir, variant.name, stored.SERVER_CHECK)
    found = None if force else stored.lookup(path, key, ServerCheck)
    if found is not None:
        out.server_check = found
        out.reused.append(f"{variant.name}/server_check")
        return None

    def check(url: str, name: str) -> None:
        model, tokenizer = load_model(variant)
        tasks, max_length = evals.task_requests(), eval_max_length(evals, variant)
        result = check_server(
            url, name, model, tokenizer, str(variant.path), tasks, max_length, docs
        )
        record = {**result, "variant": variant.name, "documents_per_task": docs}
        out.server_check = ServerCheck.from_json(record)
        stored.store(path, key, out.server_check)

    return check


def measure_serving(
    evals: Evals,
    results: list[VariantResult],
    work_dir: Path,
    force: bool,
    out: Measurements,
    progress: Callable[[str], None],
) -> None:
    """Load, chat answers and (on the first server of a model variant served in float32: the
    check's tolerance is float32's) the server check: run when the recipe has a load eval or chat
    prompts (a server answers them either way)."""
    import torch

    from serve.model.model_runner import resolve_dtype

    checked = False
    twins: Twins = {}
    for session in server_sessions(results):
        check = None
        served = resolve_dtype("auto", torch.device("cpu"), str(session.model_path))
        served_in_float32 = served == torch.float32  # as the server resolves its `auto`
        if session.model_variant is not None and served_in_float32 and not checked:
            check = _server_check(evals, session.model_variant, work_dir, force, out)
            checked = True
        for name, status in run_session(evals, session, work_dir, force, out, check, twins).items():
            progress(f"load {name}: {status}")
            if status == "reused":
                out.reused.append(f"{name}/load")
