"""The bundled lm-eval tasks (local data only) and the in-process vs server agreement check."""

from __future__ import annotations

import copy

import pytest

from evals.quality import available_tasks, offline_hub, task_manager
from evals.server_check import ABS_TOL, compare
from evals.tasks import local_data

TASKS = ["corpus_cloze", "corpus_ppl", "shakespeare_ppl", "shift_ppl", "shop_colours"]


def test_our_tasks_are_indexed_and_lm_evals_tree_is_not() -> None:
    assert sorted(available_tasks()) == TASKS
    with offline_hub():
        names = task_manager().all_subtasks
    assert sorted(names) == TASKS  # lm-eval's own (hub) tasks are not even listed


def test_cloze_items_are_well_formed() -> None:
    items = list(local_data.corpus_cloze()["test"])
    assert len(items) == local_data.CLOZE_ITEMS
    sentences = set(local_data.held_out_sentences())
    labels = set()
    for item in items:
        choices, label = item["choices"], item["label"]
        assert len(choices) == len(set(choices)) == local_data.CLOZE_CHOICES
        assert f"{item['context']} {choices[label]}" in sentences
        labels.add(label)
    assert labels == set(range(local_data.CLOZE_CHOICES))  # the answer is not always in one place
    assert items == list(local_data.corpus_cloze()["test"])  # deterministic


def test_shop_colours_answers_match_the_catalogue() -> None:
    from catalog.shifted import catalogue

    items = list(local_data.shop_colours()["test"])
    assert [f" {it.colour}." for it in catalogue()] == [q["choices"][q["label"]] for q in items]


def _results(values: dict[str, list[list]]) -> dict:
    return {
        "samples": {
            task: [{"doc_id": i, "filtered_resps": r} for i, r in enumerate(rows)]
            for task, rows in values.items()
        }
    }


def test_compare_flags_a_difference_beyond_tolerance() -> None:
    local = _results(
        {"corpus_ppl": [[-100.0], [-2000.0]], "corpus_cloze": [[(-5.0, False), (-3.0, True)]]}
    )
    same = copy.deepcopy(local)
    same["samples"]["corpus_ppl"][1]["filtered_resps"] = [-2000.0 + ABS_TOL / 2]
    assert compare(local, same)["ok"] is True
    off = copy.deepcopy(local)
    off["samples"]["corpus_ppl"][0]["filtered_resps"] = [-100.0 - 3 * ABS_TOL]
    report = compare(local, off)
    assert report["ok"] is False and report["tasks"]["corpus_cloze"]["ok"] is True
    assert report["tasks"]["corpus_ppl"]["max_abs_diff"] == pytest.approx(3 * ABS_TOL)
    greedy = copy.deepcopy(local)
    greedy["samples"]["corpus_cloze"][0]["filtered_resps"] = [(-5.0, True), (-3.0, True)]
    assert compare(local, greedy)["ok"] is False
