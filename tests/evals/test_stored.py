"""Stored measurements are typed records: read back as their type, or measured again."""

from __future__ import annotations

import json
import math
from pathlib import Path

from evals import stored
from evals.results import LoadResult, Percentiles, Point, Saturation, ServerInfo, TaskScore


def _load() -> LoadResult:
    nan = float("nan")
    point = Point(
        concurrency=1,
        prompt_len=8,
        max_tokens=4,
        requests=0,
        seconds=1.0,
        request_throughput=0.0,
        output_throughput=0.0,
        ttft=Percentiles(p50=nan, p95=nan, p99=nan, mean=nan),  # no request finished
        tpot=Percentiles(p50=0.1, p95=0.2, p99=0.3, mean=0.1),
        e2e=Percentiles(p50=1.0, p95=2.0, p99=3.0, mean=1.5),
        peak_kv_usage=0.5,
        peak_waiting=0.0,
        preemptions=0.0,
        kv_full_queued_steps=0.0,
    )
    server = ServerInfo(
        model="m", max_model_len=64, kv_blocks=None, block_size=None, kv_bytes_per_token=None
    )
    return LoadResult(
        server=server,
        kv_tokens=None,
        points=[point],
        saturation={"8": Saturation(measured_concurrency=None, estimated_concurrency=None)},
    )


def test_a_record_round_trips_through_its_json_file(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    stored.store(path, "k1", _load())
    text = path.read_text()
    assert "NaN" in text and "adapter_requests" not in text  # JSON's constant; None left out
    back = stored.lookup(path, "k1", LoadResult)
    assert back is not None and math.isnan(back.points[0].ttft.p50)
    assert back.points[0].e2e == _load().points[0].e2e and back.server == _load().server
    assert stored.lookup(path, "another key", LoadResult) is None


def test_a_stored_result_of_another_shape_is_measured_again(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    data = _load().to_json() | {"unexpected": 1}  # e.g. written by another workbench version
    path.write_text(json.dumps({"key": "k", "result": data}))
    assert stored.lookup(path, "k", LoadResult) is None
    result, reused = stored.cached(path, "k", False, LoadResult, _load)
    again = stored.lookup(path, "k", LoadResult)
    assert not reused and again is not None and again.points[0].e2e == result.points[0].e2e


def test_task_scores_leave_out_what_lm_eval_did_not_report() -> None:
    score = TaskScore.from_json({"acc": 0.5, "acc_stderr": 0.05, "samples": 100.0})
    assert score.to_json() == {"acc": 0.5, "acc_stderr": 0.05, "samples": 100.0}
    assert score.metric("acc") == 0.5 and score.metric("word_perplexity") is None
