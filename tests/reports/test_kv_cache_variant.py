"""A recipe variant served with an int8 KV cache (`serve: {kv_cache_dtype: int8}`), run end to
end beside the plain one: its own server with the flag, its saturation point moved, its quality
and divergence scored through the same arithmetic, and the report saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from catalog import ensure_demo_model
from evals.int8_kv import with_kv_cache_dtype
from evals.quality import TaskRequest, evaluate_model, summarize
from workbench import RunResult, run

RECIPE = """\
name: kv
base: demo-tiny
variants:
  - {name: base, steps: []}
  - {name: base-kv8, steps: [], serve: {kv_cache_dtype: int8}}
evals:
  quality: [corpus_ppl]
  max_length: 64
  divergence: {reference: base, data: [corpus], windows: 4, seq_len: 32}
  chat_prompts: ["hi"]
  chat_max_tokens: 6
  server_check_docs: 0
  load:
    concurrency: [1, 8, 16, 32]
    prompt_len: [48]
    max_tokens: 16
    requests_per_client: 1
    kv_cache_memory: 256KiB   # float32: 512 B/token, 512 tokens; int8: 160 B/token, 1,632
"""

pytestmark = pytest.mark.e2e  # servers in subprocesses


@pytest.fixture(scope="module")
def kv_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, dict]:
    root = tmp_path_factory.mktemp("kv-run")
    (root / "recipe.yaml").write_text(RECIPE)
    result = run(root / "recipe.yaml", root / "runs" / "kv", report_dir=root / "report")
    return result, json.loads((root / "report" / "report.json").read_text())


def _variant(report: dict, name: str) -> dict:
    return next(v for v in report["variants"] if v["name"] == name)


def test_the_int8_kv_variant_shares_the_base_artifact_and_says_how_it_serves(
    kv_run: tuple[RunResult, dict],
) -> None:
    result, report = kv_run
    assert [(v.name, v.status) for v in result.variants] == [
        ("base", "built"),
        ("base-kv8", "reused"),  # mirrored from base: same steps
    ]
    base, kv8 = _variant(report, "base"), _variant(report, "base-kv8")
    assert kv8["manifest"]["hash"] == base["manifest"]["hash"]
    assert base["serve"] == {} and kv8["serve"] == {"kv_cache_dtype": "int8"}
    assert base["row"]["steps"] == "identity"
    assert kv8["row"]["steps"] == "identity + serve(kv int8)"
    log = (result.work_dir / "evals" / "server-base-kv8.log").read_text()
    assert "1632 tokens" in log and "int8)" in log
    assert "float32)" in (result.work_dir / "evals" / "server-base.log").read_text()


def test_its_kv_cache_holds_more_tokens_and_saturates_later(
    kv_run: tuple[RunResult, dict],
) -> None:
    _, report = kv_run
    base, kv8 = _variant(report, "base")["load"], _variant(report, "base-kv8")["load"]
    assert base["server"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers, K/V, heads, dim
    assert kv8["server"]["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)  # codes + a float scale
    assert (base["kv_tokens"], kv8["kv_tokens"]) == (512, 1632)
    # 64 tokens a request: 8 fit in float32, 25 in int8 (the ramp: 1, 8, 16, 32 clients)
    assert base["saturation"]["48"]["measured_concurrency"] == 16
    assert kv8["saturation"]["48"]["measured_concurrency"] == 32
    assert all(p["failed"] == 0 for v in (base, kv8) for p in v["points"])
    sentence = next(s for s in report["recommendation"] if s.startswith("base-kv8 is base's"))
    assert sentence == (
        "base-kv8 is base's weights served with kv_cache_dtype int8: KV tokens 512 -> 1,632 "
        "(3.19x) in the same budget; KV saturation concurrency p48 16 -> p48 32."
    )


def test_its_quality_and_divergence_are_scored_as_it_serves(
    kv_run: tuple[RunResult, dict],
) -> None:
    """lm-eval's perplexity of base-kv8 is that of the model attending over int8-rounded keys
    and values (`evals.int8_kv`, which the engine equals token for token), not the base's."""
    _, report = kv_run
    base, kv8 = _variant(report, "base"), _variant(report, "base-kv8")
    path = ensure_demo_model("demo-tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    rounded = with_kv_cache_dtype(model, "int8")
    here = summarize(evaluate_model(rounded, tok, [TaskRequest("corpus_ppl")], 64), ["corpus_ppl"])
    ppl = {v["name"]: v["quality"]["tasks"]["corpus_ppl"]["word_perplexity"] for v in (base, kv8)}
    assert ppl["base-kv8"] == pytest.approx(here["corpus_ppl"]["word_perplexity"], rel=1e-6)
    assert ppl["base-kv8"] != ppl["base"]
    assert ppl["base-kv8"] == pytest.approx(ppl["base"], rel=0.05)
    kl, agree = kv8["row"]["kl_corpus"], kv8["row"]["agree_corpus"]
    assert 0 < kl < 0.05 and agree > 0.9, (kl, agree)
    assert report["answers"]["base-kv8"][0]["prompt"] == "hi"


def test_a_rerun_reuses_both_variants_measurements(kv_run: tuple[RunResult, dict]) -> None:
    """The serve setting is part of the int8 variant's stored keys and not of the plain one's:
    both are found again, and neither overwrites the other."""
    result, _ = kv_run
    root = result.work_dir.parent.parent
    again = run(root / "recipe.yaml", result.work_dir, report_dir=root / "report")
    assert again.measurements is not None
    expected = {
        f"{v}/{what}" for v in ("base", "base-kv8") for what in ("quality", "divergence", "load")
    }
    assert set(again.measurements.reused) == expected
    stored = {
        n: json.loads((result.work_dir / "evals" / n / "load.json").read_text())["key"]
        for n in ("base", "base-kv8")
    }
    assert stored["base"] != stored["base-kv8"]


def test_plain_variants_keep_their_stored_keys() -> None:
    """Regression: adding `serve:` to the recipe schema left a plain variant's keys as they were,
    so results stored before it are still reused."""
    from compress.manifest import Manifest
    from evals import stored
    from evals.serving_evals import load_key
    from evals.settings import LoadEval
    from evals.variant import VariantResult

    manifest = Manifest.model_construct(hash="abc", kind="model")
    plain = VariantResult("base", Path("x"), "reused", manifest)
    load = LoadEval()
    # (the "rate-ceiling" part: ramps stored before the capped SLO rate search are measured
    # again, on purpose; the `serve:` settings at their defaults add nothing)
    assert load_key(load, plain) == stored.key("abc", load.model_dump(mode="json"), "rate-ceiling")
