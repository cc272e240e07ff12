"""The server check (lm-eval in-process against lm-eval through the server, float32's tolerance)
runs on the first server of a model variant served in float32. An int4-wo variant runs in its own
bfloat16 under the server's `auto`: when it came first, the check compared a float32 HFLM with a
bfloat16 server and failed on every task (0.25-0.40 nats apart)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from evals import serving_evals
from evals.serving_evals import ServerSession, measure_serving
from evals.settings import ServeSettings


def _variant_dir(root: Path, name: str, int4_wo: bool) -> Path:
    path = root / name
    path.mkdir()
    if int4_wo:
        meta = {"method": "int4-wo", "group_size": 32, "skip": []}
        (path / "workbench_quantization.json").write_text(json.dumps(meta))
    return path


def test_the_server_check_runs_on_a_float32_server_not_on_int4_wo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = [
        ServerSession(
            _variant_dir(tmp_path, n, n == "int4-wo"), SimpleNamespace(name=n), ServeSettings()
        )  # type: ignore[arg-type]
        for n in ("int4-wo", "base", "int8")
    ]
    checked: list[str] = []
    monkeypatch.setattr(serving_evals, "server_sessions", lambda results: sessions)
    monkeypatch.setattr(
        serving_evals, "_server_check", lambda evals, variant, *a: f"check {variant.name}"
    )

    def run_session(evals: Any, session: ServerSession, *a: Any, **kw: Any) -> dict[str, str]:
        if a[3] is not None:
            checked.append(a[3])
        return {}

    monkeypatch.setattr(serving_evals, "run_session", run_session)
    measure_serving(SimpleNamespace(), [], tmp_path, False, SimpleNamespace(), print)  # type: ignore[arg-type]
    assert checked == ["check base"]
