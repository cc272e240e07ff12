"""The report of a real run of tests/reports/small.yaml: figures, files, reuse and --force."""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from catalog import ensure_demo_model
from evals.quality import TaskRequest, evaluate_model, summarize
from reports.metrics import (
    CAPACITY_RATE,
    KL,
    P95_E2E,
    SATURATION,
    SATURATION_ESTIMATE,
    bits_per_byte_key,
    stderr_key,
)
from reports.records import Column, Report
from reports.render import cell as render_cell
from tests.reports.conftest import Run, greedy_chat_answer, run_in, workbench_run

TASKS = ["corpus_ppl", "corpus_cloze", "shift_ppl", "shop_colours"]
VARIANTS = ["base", "int8", "shop-lora"]
CONCURRENCY, PROMPT_LENS, MAX_TOKENS = [1, 4, 8, 16, 32], [16, 48], 16

pytestmark = pytest.mark.e2e  # servers in subprocesses, the CLI as one


def cell(row: dict, column: dict) -> str:
    """A table cell as report.md shows it, the column as report.json lists it."""
    return render_cell(row, Column.from_json(column))


def report_of(run: Run) -> dict:
    return json.loads((run.report_dir / "report.json").read_text())


def test_run_returns_the_typed_values_it_reported(small_run: Run) -> None:
    result, report = small_run.result, report_of(small_run)
    assert [v.name for v in result.variants] == VARIANTS and result.built == VARIANTS
    assert result.measurements is not None and result.report is not None
    later = {"created", "reused"}  # a later test reruns the recipe through the CLI
    returned = json.loads(json.dumps(result.report))
    assert {k: v for k, v in returned.items() if k not in later} == {
        k: v for k, v in report.items() if k not in later
    }
    for v, entry in zip(result.variants, report["variants"], strict=True):
        assert entry["manifest"]["hash"] == v.manifest.hash
        load = result.measurements.load[v.name]
        assert entry["load"] == json.loads(json.dumps(load.to_json()))
        assert entry["row"]["peak_output_tok_s"] == max(p.output_throughput for p in load.points)


def test_quality_comes_from_lm_eval_over_the_local_tasks(small_run: Run) -> None:
    report = report_of(small_run)
    assert [v["name"] for v in report["variants"]] == VARIANTS
    documents = {"corpus_ppl": 34, "corpus_cloze": 200, "shift_ppl": 20, "shop_colours": 96}
    for v in report["variants"]:
        tasks = v["quality"]["tasks"]
        assert sorted(tasks) == sorted(TASKS)
        for task, n in documents.items():
            assert tasks[task]["samples"] == n
        for task in ("corpus_cloze", "shop_colours"):
            assert 0.0 <= tasks[task]["acc"] <= 1.0
            assert v["row"][task] == tasks[task]["acc"]
        for task in ("corpus_ppl", "shift_ppl"):
            assert tasks[task]["word_perplexity"] > tasks[task]["byte_perplexity"] > 1.0
            assert v["row"][task] == tasks[task]["word_perplexity"]
            assert v["row"][f"{task}_bits_per_byte"] == tasks[task]["bits_per_byte"]
    # the base's figures equal lm-eval run here, in-process, on the same model and settings
    path = ensure_demo_model("demo-tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    requests = [TaskRequest("corpus_ppl"), TaskRequest("corpus_cloze")]
    here = summarize(evaluate_model(model, tok, requests, 64), TASKS[:2])
    base = report["variants"][0]["quality"]["tasks"]
    assert here["corpus_ppl"]["word_perplexity"] == pytest.approx(
        base["corpus_ppl"]["word_perplexity"], rel=1e-6
    )
    assert here["corpus_cloze"]["acc"] == base["corpus_cloze"]["acc"]


def test_recovery_and_pareto_front(small_run: Run) -> None:
    report = report_of(small_run)
    rows = {v["name"]: v["row"] for v in report["variants"]}
    for task in TASKS:
        assert rows["base"][f"recovery_{task}"] == pytest.approx(100.0)
    assert rows["int8"]["recovery_corpus_ppl"] == pytest.approx(
        100.0 * rows["base"]["corpus_ppl_bits_per_byte"] / rows["int8"]["corpus_ppl_bits_per_byte"]
    )
    assert rows["int8"]["recovery_corpus_cloze"] == pytest.approx(
        100.0 * rows["int8"]["corpus_cloze"] / rows["base"]["corpus_cloze"]
    )
    assert rows["int8"]["weight_bytes"] < rows["base"]["weight_bytes"]
    assert rows["shop-lora"]["weight_bytes"] > rows["base"]["weight_bytes"]  # base + adapter
    # nobody trained on the corpus (the adapter trained on the shop log): its KL is the axis
    assert report["quality_axis"] == {"key": "kl_corpus", "lower_is_better": True, "excluded": []}

    def dominates(a: dict, b: dict) -> bool:
        le = a["weight_bytes"] <= b["weight_bytes"] and a["kl_corpus"] <= b["kl_corpus"]
        lt = a["weight_bytes"] < b["weight_bytes"] or a["kl_corpus"] < b["kl_corpus"]
        return le and lt

    front = set(report["pareto_front"])
    assert front, "some variant is always on the front"
    for name, row in rows.items():
        beaten = any(dominates(other, row) for o, other in rows.items() if o != name)
        assert beaten == (name not in front), name


def test_paired_comparisons_equal_a_direct_computation_from_the_stored_scores(
    small_run: Run,
) -> None:
    from evals.paired import (
        accuracy_difference,
        adjust,
        bits_per_byte_difference,
        window_difference,
    )

    report = report_of(small_run)
    comparisons = report["comparisons"]
    assert comparisons["reference"] == "base" and comparisons["unpaired"] == []
    stored = {
        v: json.loads((small_run.root / f"runs/small/evals/{v}/quality.json").read_text())
        for v in VARIANTS
    }
    items = {v: s["result"]["items"] for v, s in stored.items()}
    rows = {(r["variant"], r["metric"]): r for r in comparisons["rows"]}
    # two variants x (2 accuracy tasks + 2 perplexity tasks + 2 divergence data sets)
    assert len(rows) == 2 * 6
    for v in ("int8", "shop-lora"):
        for task in ("corpus_cloze", "shop_colours"):
            base, var = items["base"][task], items[v][task]
            assert base["ids"] == var["ids"] and len(var["ids"]) == var_n(report, v, task)
            expected = accuracy_difference(base["acc"], var["acc"])
            assert rows[(v, task)]["delta"] == pytest.approx(expected.delta)
            assert rows[(v, task)]["p"] == pytest.approx(expected.p)
            assert rows[(v, task)]["pairing"] == "accuracy"
        for task in ("corpus_ppl", "shift_ppl"):
            base, var = items["base"][task], items[v][task]
            expected = bits_per_byte_difference(
                base["loglikelihood"], var["loglikelihood"], base["bytes"]
            )
            assert rows[(v, task)]["delta"] == pytest.approx(expected.delta)
            row = next(x["row"] for x in report["variants"] if x["name"] == v)
            base_row = report["variants"][0]["row"]
            assert expected.delta == pytest.approx(
                row[f"{task}_bits_per_byte"] - base_row[f"{task}_bits_per_byte"], rel=1e-6
            )
        for data in ("corpus", "shift"):
            stats = next(x for x in report["variants"] if x["name"] == v)["quality"]
            d = stats["divergence"]["data"][data]
            expected = window_difference(d["window_reference_nll"], d["window_nll"])
            assert rows[(v, f"ppl_{data}")]["delta"] == pytest.approx(expected.delta)
    ordered = comparisons["rows"]
    assert [r["p_adjusted"] for r in ordered] == pytest.approx(adjust([r["p"] for r in ordered]))
    # the adapter learned the shop log: its bits per byte there are detectably lower
    assert rows[("shop-lora", "shift_ppl")]["verdict"] == "better"
    assert rows[("shop-lora", "shift_ppl")]["delta"] < 0


def var_n(report: dict, variant: str, task: str) -> int:
    v = next(x for x in report["variants"] if x["name"] == variant)
    return int(v["quality"]["tasks"][task]["samples"])


def test_load_points_and_kv_saturation(small_run: Run) -> None:
    report = report_of(small_run)
    config = AutoConfig.from_pretrained(ensure_demo_model("demo-tiny"))
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    for v in report["variants"]:
        load = v["load"]
        assert load["server"]["model"] == v["name"]  # an adapter is requested by its own name
        assert load["server"]["kv_bytes_per_token"] == kv_bytes == v["row"]["kv_bytes_per_token"]
        assert load["kv_tokens"] == 256 * 1024 // kv_bytes
        points = {(p["concurrency"], p["prompt_len"]): p for p in load["points"]}
        assert sorted(points) == sorted((c, p) for c in CONCURRENCY for p in PROMPT_LENS)
        for (c, _), point in points.items():
            assert point["requests"] == max(2 * c, 8) and point["failed"] == 0
            assert point["output_throughput"] > 0
            assert point["e2e"]["p50"] <= point["e2e"]["p95"] <= point["e2e"]["p99"]
            assert point["saturated"] == (point["kv_full_queued_steps"] > 0)
        for p in PROMPT_LENS:
            sat = load["saturation"][str(p)]
            assert sat["estimated_concurrency"] == pytest.approx(
                load["kv_tokens"] / (p + MAX_TOKENS)
            )
            first = next((c for c in CONCURRENCY if points[(c, p)]["saturated"]), None)
            assert sat["measured_concurrency"] == first
            assert v["row"][f"saturation_p{p}"] == first
        if v["name"] == "shop-lora":  # hot-loaded on the base's server, ran every request
            chats = len(report["answers"]["shop-lora"])  # its chat answers, asked first
            every = [*load["points"], *load["rate_points"]]
            every += [p for c in load["capacity"].values() for p in c["searched"]]
            assert load["adapter_requests"] == sum(p["requests"] for p in every) + chats
        # 32 clients x 64 tokens need 4x the 512-token cache: the longer prompts must saturate
        assert load["saturation"]["48"]["measured_concurrency"] is not None
        assert v["row"]["p95_e2e_c16_p48"] == points[(16, 48)]["e2e"]["p95"]
        assert v["row"]["p95_itl_c16_p48"] == points[(16, 48)]["itl"]["p95"]
        # open-loop points at the recipe's rate, and the capacity within its SLO
        assert [(p["request_rate"], p["prompt_len"]) for p in load["rate_points"]] == [
            (30, 16),
            (30, 48),
        ]
        for p in PROMPT_LENS:
            cap = load["capacity"][str(p)]
            assert cap["slo"] == {"ttft_p95_s": 2.0}
            # searched from the ramp's peak, never above it: two points, or one when the peak
            # itself met the SLO
            searched = cap["searched"]
            peak = max(points[(c, p)]["request_throughput"] for c in CONCURRENCY)
            assert searched[0]["request_rate"] == peak
            assert all(s["request_rate"] <= peak for s in searched)
            assert len(searched) == 2 or (len(searched) == 1 and searched[0]["ttft"]["p95"] <= 2.0)
            assert v["row"][f"capacity_rate_p{p}"] == cap["request_rate"]
            assert v["row"][f"capacity_conc_p{p}"] == cap["concurrency"]
            met = [c for c in CONCURRENCY if points[(c, p)]["ttft"]["p95"] <= 2.0]
            assert cap["concurrency"] == max(met)
        assert v["row"]["failed_requests"] == 0
        measured = v["load"]["measured"]  # when and where: this run, this machine
        assert measured["host"] == platform.node() and measured["cpu_count"] == os.cpu_count()
        assert report["created"] >= measured["started"] and 0 < measured["seconds"] < 900
        where = f"{platform.node()} ({measured['cpu']}, {os.cpu_count()} CPUs)"  # no GPU here
        assert v["row"]["ran_on"] == where and v["load"].get("gpu") is None
        assert f"| {where} |" in (small_run.report_dir / "report.md").read_text()
    assert report["problems"] == []
    # measured back to back: one sitting, which the report leaves unsaid
    assert [s["variants"] for s in report["load_sittings"]] == [VARIANTS]
    assert "sittings" not in (small_run.report_dir / "report.md").read_text()


def test_server_check_agrees(small_run: Run) -> None:
    check = report_of(small_run)["server_check"]
    assert check["variant"] == "base" and check["ok"] is True
    assert sorted(check["tasks"]) == sorted(TASKS)
    for t in check["tasks"].values():
        assert t["requests"] >= 4 and t["max_abs_diff"] <= check["abs_tol"]


def test_markdown_and_html(small_run: Run) -> None:
    report = report_of(small_run)
    md = (small_run.report_dir / "report.md").read_text()
    page = (small_run.report_dir / "index.html").read_text()
    groups = {c["group"] for c in report["columns"]}
    assert groups == {"variant", "memory", "quality", "divergence", "serving"}
    for group, title in [("memory", "Memory"), ("quality", "Quality (lm-eval)"),
                         ("divergence", "Divergence from the reference"),
                         ("serving", "Serving under load")]:  # fmt: skip
        cols = [c for c in report["columns"] if c["group"] == group]
        if group == "memory":
            cols = [c for c in report["columns"] if c["group"] == "variant"] + cols
        else:
            cols = [report["columns"][0], *cols]
        assert f"## {title}" in md
        assert "| " + " | ".join(c["label"] for c in cols) + " |" in md
        for v in report["variants"]:
            cells = [cell(v["row"], c) for c in cols]
            assert "| " + " | ".join(cells) + " |" in md
        table = page[page.index(f"<table id='{group}'>") :]
        table = table[: table.index("</table>")]
        assert table.count("<tr>") == 1 + len(VARIANTS)
    for c in report["columns"]:
        if c["format"] == "pct" and c["key"] in TASKS:  # accuracy ± its standard error
            assert c["label"].startswith(f"{c['key']} (acc, n=")
            for v in report["variants"]:
                stderr = v["row"][f"{c['key']}_stderr"]
                assert f"{100 * v['row'][c['key']]:.1f}% ± {100 * stderr:.1f}" in md
    # the recommendation leads, and every sentence of report.json is in both files
    assert md.index("## Recommendation") < md.index("## Memory")
    for sentence in report["recommendation"]:
        assert f"- {sentence}" in md
    assert page.index("id='recommendation'") < page.index("<table id='memory'>")
    assert "## Paired against base" in md
    paired = page[page.index("<table id='paired'>") :]
    assert paired[: paired.index("</table>")].count("<tr>") == 1 + len(
        report["comparisons"]["rows"]
    )
    for plot in ("quality", "throughput", "latency", "kv", "capacity"):
        assert f'id="plot-{plot}"' in page
    assert (small_run.report_dir / "plotly.min.js").stat().st_size > 1_000_000


def _plotted(page: str, plot: str) -> list[dict]:
    """The traces index.html hands Plotly for the div `plot-<plot>`."""
    start = page.index(f'"plot-{plot}",', page.index("Plotly.newPlot("))
    data, _ = json.JSONDecoder().raw_decode(page, page.index("[", start))
    return data


def test_the_report_opens_with_quality_against_memory_with_capacity(small_run: Run) -> None:
    """One point per variant: x its weights (MB), y the quality axis, customdata the clients its
    KV cache held at saturation on the longest prompt (measured, else estimated)."""
    report = report_of(small_run)
    page = (small_run.report_dir / "index.html").read_text()
    assert page.index('id="plot-summary"') < page.index("id='recommendation'")
    assert page.index('id="plot-summary"') < page.index("<table id='memory'>")
    (trace,) = _plotted(page, "summary")
    key, longest = report["quality_axis"]["key"], max(PROMPT_LENS)
    rows = [v["row"] for v in report["variants"]]
    assert trace["text"] == VARIANTS
    assert trace["x"] == [r["weight_bytes"] / 1e6 for r in rows]
    assert trace["y"] == [r[key] for r in rows]
    clients = [r[SATURATION.key(longest)] or r[SATURATION_ESTIMATE.key(longest)] for r in rows]
    assert trace["customdata"] == clients and all(c for c in clients)
    sizes = trace["marker"]["size"]
    assert sizes[clients.index(max(clients))] == max(sizes) == 40


def test_every_row_key_is_a_declared_metric_or_its_companion(small_run: Run) -> None:
    """The registry owns the row keys: each is a column, a column's standard error or bits per
    byte, or one of the manifest's own fields that no table shows."""
    report = report_of(small_run)
    columns = {c["key"] for c in report["columns"]}
    companions = {stderr_key(k) for k in columns} | {bits_per_byte_key(k) for k in columns}
    unshown = {"kind", "trainable_parameters", "bytes_on_disk", "kv_tokens"}
    for v in report["variants"]:
        assert set(v["row"]) - columns - companions <= unshown, v["name"]
    serves = {v["name"]: v["row"]["serves_in"] for v in report["variants"]}
    assert serves["base"].endswith("llama.cpp (export --format gguf)")
    assert serves["int8"] == "this engine; transformers (as stored)"  # bitsandbytes
    assert "vLLM --enable-lora" in serves["shop-lora"]
    lengths = [str(n) for n in PROMPT_LENS]
    for family in (CAPACITY_RATE, P95_E2E, SATURATION):
        assert sorted(family.values(report["variants"][0]["row"])) == lengths


def test_the_run_summary_shows_the_metrics_declaring_a_short_label(small_run: Run) -> None:
    from workbench.cli import _report_table

    report = report_of(small_run)
    headers = [str(c.header) for c in _report_table(Report.from_json(report)).columns]
    assert headers == [c["short"] for c in report["columns"] if c.get("short")]
    assert headers[:2] == ["variant", "weights"] and "paired verdicts" in headers
    assert {*TASKS, "peak tok/s", "sat. p16", "req/s in SLO p48"} <= set(headers)


def _eval_files(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in sorted((root / "runs").rglob("evals/*/*.json"))}


def test_rerun_reuses_variants_and_measurements(small_run: Run) -> None:
    """Through the CLI, which prints what `run` returned."""
    before = _eval_files(small_run.root)
    output = workbench_run(small_run.root)
    assert "built 0 variant(s) [], reused 3 ['base', 'int8', 'shop-lora']" in output
    report = json.loads((small_run.report_dir / "report.json").read_text())
    expected = [f"{v}/{what}" for v in VARIANTS for what in ("quality", "divergence", "load")]
    assert sorted(report["reused"]) == sorted([*expected, "base/server_check"])
    assert _eval_files(small_run.root) == before


def test_force_builds_and_measures_again(small_run: Run, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(small_run.root, root)
    before = json.loads((root / "runs/small/variants/base/workbench.json").read_text())
    measured_before = {k: v for k, v in _eval_files(root).items() if "/evals/base/" in k}
    assert len(measured_before) == 5  # quality, divergence, answers, load, server_check
    result = run_in(root, force=True, variants=["base"])
    assert result.built == ["base"] and result.reused == []
    report = report_of(Run(root, result))
    assert report["reused"] == [] and [v["name"] for v in report["variants"]] == ["base"]
    after = json.loads((root / "runs/small/variants/base/workbench.json").read_text())
    assert after["hash"] == before["hash"]
    measured_after = {k: v for k, v in _eval_files(root).items() if "/evals/base/" in k}
    assert measured_after.keys() == measured_before.keys()
    assert all(measured_after[k] != measured_before[k] for k in measured_after)
    stored = json.loads((root / "runs/small/evals/base/quality.json").read_text())
    divergence = json.loads((root / "runs/small/evals/base/divergence.json").read_text())
    quality = report["variants"][0]["quality"]
    items = stored["result"].pop("items")  # per-document scores stay in the work dir
    assert set(items) == set(TASKS)
    assert stored["result"] | {"divergence": divergence["result"]} == quality


def test_manifests_leave_perplexity_to_the_divergence_eval(small_run: Run) -> None:
    """With a divergence eval in the recipe the build records memory and load time only: its
    perplexity would repeat the divergence eval's forward passes on the same rows."""
    for name in VARIANTS:
        manifest = json.loads(
            (small_run.root / f"runs/small/variants/{name}/workbench.json").read_text()
        )
        assert manifest["eval"]["eval_rows"] == 0 and manifest["eval"]["bytes_in_memory"] > 0
        assert "perplexity_corpus" not in manifest["eval"]
    report = report_of(small_run)
    assert all(
        v["quality"]["divergence"]["data"]["corpus"]["perplexity"] > 1 for v in report["variants"]
    )


def test_divergence_and_chat_answers_of_every_variant(small_run: Run) -> None:
    report = report_of(small_run)
    rows = {v["name"]: v["row"] for v in report["variants"]}
    assert rows["base"]["kl_corpus"] == 0.0 and rows["base"]["agree_shift"] == 1.0
    assert rows["int8"]["kl_corpus"] > 0 and rows["int8"]["agree_corpus"] > 0.9
    # the adapter moved the shop log's distribution more than int8 did
    assert rows["shop-lora"]["kl_shift"] > rows["int8"]["kl_shift"]
    assert rows["shop-lora"]["agree_shift"] < 1
    # a family reads its figures per data set, not their standard errors beside them
    assert rows["int8"]["kl_corpus_stderr"] > 0
    assert set(KL.values(rows["int8"])) == {"corpus", "shift"}
    base_ppl = report["variants"][0]["quality"]["divergence"]["data"]["corpus"]["perplexity"]
    assert rows["base"]["ppl_corpus"] == base_ppl
    for v in report["variants"][1:]:
        stats = v["quality"]["divergence"]["data"]["corpus"]
        assert stats["reference_perplexity"] == base_ppl  # the reference scored once
    answers = report["answers"]
    assert sorted(answers) == sorted(VARIANTS)
    assert [a["prompt"] for a in answers["base"]] == ["Return the", "hi"]
    # the base's answer over HTTP equals greedy generate on the chat template
    assert answers["base"][1]["answer"] == greedy_chat_answer("hi", 6)
    md = (small_run.report_dir / "report.md").read_text()
    assert "### hi" in md and "KL vs base (corpus, nats)" in md
    page = (small_run.report_dir / "index.html").read_text()
    assert page.count("class='answer'") == 2 * len(VARIANTS)
