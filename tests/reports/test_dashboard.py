"""`workbench dashboard` in a real headless browser (Debian's chromium + chromedriver, which
`make test` installs): rows, cells and plot traces against report.json; sorting; choosing runs
and variants; a screenshot."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from reports.dashboard import PAIRED_HEAD, build_app
from reports.records import Column, Report
from reports.render import cell as report_cell
from reports.render import comparison_rows
from tests.reports.conftest import Run

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e  # `workbench run` as a subprocess, a browser


@pytest.fixture
def reports_dir(small_run: Run, tmp_path: Path) -> Path:
    """Two runs: the small recipe's report, and a copy named `other` without its int8 variant
    and with the base's weight memory doubled (so the runs sort apart)."""
    root = tmp_path / "reports"
    shutil.copytree(small_run.report_dir, root / "small")
    other = json.loads((small_run.report_dir / "report.json").read_text())
    other["variants"] = [v for v in other["variants"] if v["name"] != "int8"]
    other["variants"][0]["row"]["weight_bytes"] *= 2
    (root / "other").mkdir()
    (root / "other" / "report.json").write_text(json.dumps(other))
    return root


@contextlib.contextmanager
def serving(root: Path) -> Iterator[str]:
    """The dashboard over `root` on a free loopback port, in a thread; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(root), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def dashboard(reports_dir: Path) -> Iterator[str]:
    with serving(reports_dir) as url:
        yield url


@pytest.fixture
def browser() -> Iterator[object]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed and could not be "
            "(`make test` runs apt-get install chromium chromium-driver as root)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--window-size=1400,2400",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def _wait_updates(driver: object, count: int) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(
        lambda d: int(d.execute_script("return document.body.dataset.updates || 0")) >= count
    )


def _labels(driver: object) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#variants-table tbody tr')].map(r => r.dataset.label)"
    )


def _traces(driver: object, plot: str) -> list[str]:
    return driver.execute_script(
        f"return document.getElementById('plot-{plot}').data.map(t => t.name)"
    )


def _click(driver: object, selector: str) -> None:
    driver.execute_script(f"document.querySelector({json.dumps(selector)}).click()")


def test_dashboard_in_a_real_browser(
    browser: object, dashboard: str, reports_dir: Path, tmp_path: Path
) -> None:
    reports = {
        r: json.loads((reports_dir / r / "report.json").read_text()) for r in ("other", "small")
    }
    browser.get(dashboard + "/")
    _wait_updates(browser, 1)

    # every variant of both runs, in run order, with each cell as report.json formats it
    expected = [f"{run} / {v['name']}" for run, r in reports.items() for v in r["variants"]]
    assert _labels(browser) == expected
    for run, r in reports.items():
        for v in r["variants"]:
            label = f"{run} / {v['name']}"
            for c in r["columns"][1:]:
                cell = browser.execute_script(
                    "return document.querySelector(`tr[data-label='${arguments[0]}'] "
                    "td[data-key='${arguments[1]}']`).textContent",
                    label,
                    c["key"],
                )
                assert cell == report_cell(v["row"], Column.from_json(c)), (label, c["key"])

    # one trace per variant (+ the Pareto front); one per variant and prompt length in the load plots
    assert _traces(browser, "quality") == [*expected, "Pareto front"]
    lens = reports["small"]["settings"]["load"]["prompt_len"]
    assert _traces(browser, "throughput") == [label for label in expected for _ in lens]
    kv_names = _traces(browser, "kv")
    assert kv_names[: len(expected) * len(lens)] == [label for label in expected for _ in lens]
    assert sum(name.endswith(" estimate") for name in kv_names) == len(expected) * len(lens)
    with_capacity = [
        f"{run} / {v['name']}"
        for run, r in reports.items()
        for v in r["variants"]
        if any(x is not None for k, x in v["row"].items() if k.startswith("capacity_rate_p"))
    ]
    assert with_capacity and _traces(browser, "capacity") == with_capacity

    # sort by weight memory: ascending, then descending on a second click
    weights = {
        f"{run} / {v['name']}": v["row"]["weight_bytes"]
        for run, r in reports.items()
        for v in r["variants"]
    }
    _click(browser, "th[data-key='weight_bytes']")
    ascending = _labels(browser)
    assert [weights[x] for x in ascending] == sorted(weights.values())
    _click(browser, "th[data-key='weight_bytes']")
    assert [weights[x] for x in _labels(browser)] == sorted(weights.values(), reverse=True)

    # untick a variant, then a whole run: the table and the plots follow
    _click(browser, "#variants input[value='small / int8']")
    _wait_updates(browser, 2)
    assert "small / int8" not in _labels(browser)
    assert "small / int8" not in _traces(browser, "quality")
    _click(browser, "#runs input[value='other']")
    _wait_updates(browser, 3)
    assert sorted(_labels(browser)) == sorted(
        f"small / {v['name']}" for v in reports["small"]["variants"]
    )
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]

    shot = Path(os.environ.get("WORKBENCH_SCREENSHOT_DIR", tmp_path)) / "dashboard.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    _click(browser, "#runs input[value='other']")
    _wait_updates(browser, 4)
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def _paired(driver: object) -> list[list[str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#paired-table tbody tr')]"
        ".map(r => [...r.children].map(td => td.textContent))"
    )


def test_paired_comparisons_of_the_variants_shown_in_a_real_browser(
    browser: object, dashboard: str, reports_dir: Path
) -> None:
    reports = {
        r: json.loads((reports_dir / r / "report.json").read_text()) for r in ("other", "small")
    }

    def expected(hide: set[str]) -> list[list[str]]:
        out = []
        for run, report in reports.items():
            names = {v["name"] for v in report["variants"]}
            reference = report["comparisons"]["reference"]
            for cells in comparison_rows(Report.from_json(report)):
                label = f"{run} / {cells[0]}"
                if cells[0] in names and label not in hide:
                    out.append([label, f"{run} / {reference}", *cells[1:]])
        return out

    browser.get(dashboard + "/")
    _wait_updates(browser, 1)
    head = browser.execute_script(
        "return [...document.querySelectorAll('#paired-table th')].map(th => th.textContent)"
    )
    assert head == PAIRED_HEAD
    shown = _paired(browser)
    # `other` lost its int8 variant: its comparisons stay in its report.json, not on the page
    assert shown == expected(set()) and len(shown) > 0
    assert not any(row[0] == "other / int8" for row in shown)
    assert any(row[0] == "small / int8" for row in shown)

    _click(browser, "#variants input[value='small / int8']")
    _wait_updates(browser, 2)
    assert _paired(browser) == expected({"small / int8"})
    # a budget below every variant: nothing shown, nothing paired
    _set_filter(browser, "budget-mb", "0.000001")
    _wait_updates(browser, 3)
    time.sleep(1)
    assert _paired(browser) == [] and browser.find_element("id", "paired-none").is_displayed()
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_unknown_run_is_a_clear_404(dashboard: str) -> None:
    r = httpx.get(f"{dashboard}/api/compare", params={"runs": "small,nope"})
    assert r.status_code == 404
    assert (
        "no report for run(s) nope" in r.json()["detail"]
        and "known: other, small" in r.json()["detail"]
    )


def test_a_run_named_2000_times_is_compared_once(
    dashboard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/api/compare?runs=small,small,...` (2,000 names) did not answer in 60 s: names were not
    deduplicated, and every request re-checked every report by building its figures."""
    from reports import dashboard as dashboard_mod

    once = httpx.get(f"{dashboard}/api/compare", params={"runs": "small"}, timeout=60)
    checks: list[str] = []
    real = dashboard_mod.report_problem
    monkeypatch.setattr(
        dashboard_mod, "report_problem", lambda run, r: checks.append(run) or real(run, r)
    )
    many = httpx.get(f"{dashboard}/api/compare", params={"runs": ",".join(["small"] * 2000)})
    assert many.status_code == 200 and many.json() == once.json()
    assert checks == []  # unchanged reports are not re-checked


def _add_bad_reports(root: Path) -> dict[str, str]:
    """Files that are JSON but not reports, each with the words its note must carry."""
    bad = {
        "a-list": ([1, 2], "holds a JSON list"),
        "not-a-report": ({"hello": "world"}, "no title, created, columns, variants"),
        "bad-variants": (
            {"title": "t", "created": "c", "columns": [], "variants": "x", "quality_axis": {}},
            "dashboard can show",
        ),
    }
    for run, (content, _) in bad.items():
        (root / run).mkdir()
        (root / run / "report.json").write_text(json.dumps(content))
    return {run: words for run, (_, words) in bad.items()}


def test_report_json_that_is_not_a_report_is_skipped_with_a_note(
    dashboard: str, reports_dir: Path
) -> None:
    bad = _add_bad_reports(reports_dir)
    runs = httpx.get(f"{dashboard}/api/runs")
    assert runs.status_code == 200
    assert [r["run"] for r in runs.json()] == ["other", "small"]
    skipped = {
        Path(s["file"]).parent.name: s["problem"]
        for s in httpx.get(f"{dashboard}/api/skipped").json()
    }
    assert sorted(skipped) == sorted(bad)
    for run, words in bad.items():
        assert words in skipped[run], (run, skipped[run])
    compared = httpx.get(f"{dashboard}/api/compare", params={"runs": "other,small"})
    assert compared.status_code == 200 and compared.json()["rows"]


def test_bad_report_note_shows_in_a_real_browser(
    browser: object, dashboard: str, reports_dir: Path
) -> None:
    bad = _add_bad_reports(reports_dir)
    browser.get(dashboard + "/")
    _wait_updates(browser, 1)
    notes = browser.execute_script(
        "return [...document.querySelectorAll('#skipped li')].map(li => li.textContent)"
    )
    assert len(notes) == len(bad)
    for run in bad:
        assert any(f"{run}/report.json" in note for note in notes), notes
    assert len(_labels(browser)) > 0


def _set_filter(driver: object, element_id: str, value: str) -> None:
    driver.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('change'));",
        element_id,
        value,
    )


def test_dashboard_filters_by_memory_budget_and_slo_in_a_real_browser(
    browser: object, dashboard: str, reports_dir: Path
) -> None:
    reports = {
        r: json.loads((reports_dir / r / "report.json").read_text()) for r in ("other", "small")
    }
    rows = {f"{run} / {v['name']}": v["row"] for run, r in reports.items() for v in r["variants"]}
    browser.get(dashboard + "/")
    _wait_updates(browser, 1)
    small = {v["name"]: v["row"] for v in reports["small"]["variants"]}
    budget = (small["int8"]["weight_bytes"] + small["base"]["weight_bytes"]) / 2
    _set_filter(browser, "budget-mb", str(budget / 1e6))
    _wait_updates(browser, 2)
    kept = [label for label, row in rows.items() if row["weight_bytes"] <= budget]
    assert 0 < len(kept) < len(rows) and _labels(browser) == kept
    assert [t for t in _traces(browser, "quality") if t != "Pareto front"] == kept
    status = browser.find_element("id", "status").text
    assert f"{len(rows) - len(kept)} hidden by the filters" in status

    # a capacity no variant reaches within its SLO: nothing is left (set right after clearing
    # the budget: the answer to the first change must not overwrite the second's)
    _set_filter(browser, "budget-mb", "")
    top = max(v for row in rows.values() for k, v in row.items() if k.startswith("capacity_rate"))
    _set_filter(browser, "min-rate", str(2 * top))
    _wait_updates(browser, 3)
    time.sleep(1)  # an older answer arriving late would show here
    assert _labels(browser) == []
    # a p95 bound between the variants' worst p95s at 16 clients
    _set_filter(browser, "min-rate", "")
    worst = {
        label: max(v for k, v in row.items() if k.startswith("p95_e2e_c16_p"))
        for label, row in rows.items()
    }
    bound = sorted(worst.values())[len(worst) // 2]
    _set_filter(browser, "max-e2e", str(bound))
    _wait_updates(browser, 4)
    time.sleep(1)
    assert _labels(browser) == [label for label, w in worst.items() if w <= bound]
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_filters_over_http(dashboard: str, reports_dir: Path) -> None:
    report = json.loads((reports_dir / "small" / "report.json").read_text())
    rates = {
        v["name"]: min(
            (x if x is not None else -1.0)
            for k, x in v["row"].items()
            if k.startswith("capacity_rate_p")
        )
        for v in report["variants"]
    }
    floor = sorted(rates.values())[1]
    r = httpx.get(f"{dashboard}/api/compare", params={"runs": "small", "min_slo_rate": floor})
    assert r.status_code == 200
    shown = [row["variant"] for row in r.json()["rows"]]
    assert shown == [n for n, rate in rates.items() if rate >= floor]
    assert r.json()["hidden"] == [f"small / {n}" for n, rate in rates.items() if rate < floor]
    bad = httpx.get(f"{dashboard}/api/compare", params={"runs": "small", "budget_mb": "-1"})
    assert bad.status_code == 422 and "budget_mb" in bad.text


MINIMAL_REPORT = {
    "title": "mine",
    "created": "2026-12-07",
    "columns": [{"key": "variant", "label": "variant", "format": "text"}],
    "variants": [{"name": "base", "row": {"variant": "base"}, "load": None}],
    "quality_axis": {"key": None},
}
"""The least a report holds for the dashboard to list and compare it (no run needed)."""


@pytest.fixture
def own_reports(tmp_path: Path) -> Path:
    """A reports dir holding one hand-made report, `mine`."""
    root = tmp_path / "reports"
    (root / "mine").mkdir(parents=True)
    (root / "mine" / "report.json").write_text(json.dumps(MINIMAL_REPORT))
    return root


@pytest.fixture
def own_dashboard(own_reports: Path) -> Iterator[str]:
    with serving(own_reports) as url:
        yield url


def _skipped(url: str) -> dict[str, str]:
    notes = httpx.get(f"{url}/api/skipped", timeout=30).json()
    return {Path(s["file"]).parent.name: s["problem"] for s in notes}


def test_foreign_host_rebind_evil_example_reads_no_report(own_dashboard: str) -> None:
    """A page whose name was rebound to 127.0.0.1 (Host: rebind.evil.example) read every
    report, /api/skipped and the page: the dashboard had no Host check."""
    port = own_dashboard.rsplit(":", 1)[1]
    for route in ("/", "/api/runs", "/api/skipped", "/api/compare?runs=mine"):
        foreign = httpx.get(own_dashboard + route, headers={"Host": "rebind.evil.example"})
        assert foreign.status_code == 403, route
        assert "rebind.evil.example" in foreign.json()["error"]["message"]
        assert "mine" not in foreign.text
        own = httpx.get(own_dashboard + route, headers={"Host": f"localhost:{port}"})
        assert own.status_code == 200, route
    runs = httpx.get(own_dashboard + "/api/runs", headers={"Host": f"[::1]:{port}"})
    assert [r["run"] for r in runs.json()] == ["mine"]


def test_foreign_origin_reads_no_report(own_dashboard: str) -> None:
    """A cross-site page's request (Origin of another site) is refused; the dashboard's own
    page (same origin) is answered."""
    foreign = httpx.get(
        own_dashboard + "/api/runs", headers={"Origin": "http://rebind.evil.example"}
    )
    assert foreign.status_code == 403 and "mine" not in foreign.text
    assert "cross-origin request" in foreign.json()["error"]["message"]
    same = httpx.get(own_dashboard + "/api/runs", headers={"Origin": own_dashboard})
    assert same.status_code == 200 and [r["run"] for r in same.json()] == ["mine"]


def test_allowed_host_is_answered(own_reports: Path) -> None:
    app = build_app(own_reports, "127.0.0.1", allowed_hosts="dash.example")
    with TestClient(app, base_url="http://dash.example") as client:
        assert client.get("/api/runs").json()[0]["run"] == "mine"
    with TestClient(app, base_url="http://rebind.evil.example") as client:
        assert client.get("/api/runs").status_code == 403


def test_fifo_named_report_json_does_not_hang_api_runs(
    own_dashboard: str, own_reports: Path
) -> None:
    """A FIFO named report.json hung /api/runs (its open waited for a writer that never
    came): now it is skipped unopened, with a note, and the other reports are listed."""
    (own_reports / "pipe").mkdir()
    os.mkfifo(own_reports / "pipe" / "report.json")
    runs = httpx.get(f"{own_dashboard}/api/runs", timeout=30)
    assert [r["run"] for r in runs.json()] == ["mine"]
    assert "is a FIFO, not a regular file" in _skipped(own_dashboard)["pipe"]
    compared = httpx.get(f"{own_dashboard}/api/compare", params={"runs": "mine"}, timeout=30)
    assert [row["label"] for row in compared.json()["rows"]] == ["mine / base"]


def test_special_files_named_report_json_are_skipped_with_a_note(
    own_dashboard: str, own_reports: Path
) -> None:
    """A directory, a device and a socket named report.json: each skipped, named by kind."""
    (own_reports / "dir" / "report.json").mkdir(parents=True)
    (own_reports / "device").mkdir()
    (own_reports / "device" / "report.json").symlink_to("/dev/zero")
    (own_reports / "sock").mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(own_reports / "sock" / "report.json"))
    try:
        skipped = _skipped(own_dashboard)
    finally:
        listener.close()
    assert "is a directory" in skipped["dir"]
    assert "is a character device" in skipped["device"]
    assert "is a socket" in skipped["sock"]
    runs = httpx.get(f"{own_dashboard}/api/runs", timeout=30).json()
    assert [r["run"] for r in runs] == ["mine"]


def test_oversized_report_json_is_skipped_unread(
    own_dashboard: str, own_reports: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reports import dashboard as dashboard_mod

    monkeypatch.setattr(dashboard_mod, "MAX_REPORT_BYTES", 4096)
    (own_reports / "big").mkdir()
    big = {**MINIMAL_REPORT, "title": "x" * 5000}
    (own_reports / "big" / "report.json").write_text(json.dumps(big))
    read: list[Path] = []
    real = dashboard_mod.read_regular_file
    monkeypatch.setattr(
        dashboard_mod, "read_regular_file", lambda p, n: read.append(p) or real(p, n)
    )
    skipped = _skipped(own_dashboard)
    assert "over the 4,096 bytes a report may have" in skipped["big"]
    assert own_reports / "big" / "report.json" not in read


def test_report_json_that_is_not_json_is_skipped_with_a_note(
    own_dashboard: str, own_reports: Path
) -> None:
    """Text that does not parse, bytes that are not UTF-8, and JSON nested deeper than the
    parser takes ('[' x 100,000: a RecursionError) are each skipped with a note."""
    cases = {"text": b"{not json", "latin1": b'{"title": "\xe9"}', "deep": b"[" * 100_000}
    for run, content in cases.items():
        (own_reports / run).mkdir()
        (own_reports / run / "report.json").write_bytes(content)
    skipped = _skipped(own_dashboard)
    assert "is not JSON" in skipped["text"] and "is not JSON" in skipped["latin1"]
    assert "nests deeper than the parser takes" in skipped["deep"]
    assert [r["run"] for r in httpx.get(f"{own_dashboard}/api/runs").json()] == ["mine"]


def test_fifo_named_report_json_does_not_keep_the_dashboard_from_starting(
    own_reports: Path,
) -> None:
    """`workbench dashboard` read every report before it listened: a FIFO named report.json
    kept it from ever starting. Now it starts, prints the skipped file, and serves."""
    (own_reports / "pipe").mkdir()
    os.mkfifo(own_reports / "pipe" / "report.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "dashboard", str(own_reports), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed after the scan, before it listens
        assert first.startswith("dashboard over 1 run(s)"), first
        assert "pipe/report.json: is a FIFO" in proc.stdout.readline()
        runs = _get_when_listening(f"http://127.0.0.1:{port}/api/runs", proc)
        assert [r["run"] for r in runs.json()] == ["mine"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _get_when_listening(url: str, proc: subprocess.Popen) -> httpx.Response:
    for _ in range(600):
        assert proc.poll() is None, "the dashboard exited"
        with contextlib.suppress(httpx.ConnectError):
            return httpx.get(url, timeout=30)
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer")


def test_compare_answers_the_summary_figure_and_each_runs_problems(reports_dir: Path) -> None:
    """A run's problems (a failed gate here) come with its rows; the summary figure has one
    point per variant shown, labelled `run / variant`; a report written before gates, sittings
    and seen data existed is compared like the others."""
    path = reports_dir / "other" / "report.json"
    other = json.loads(path.read_text())
    gate = "shop-lora: gate recovery.corpus_ppl (at least 2) failed: measured 0.998"
    other["problems"] = [gate]
    for key in ("gates", "load_sittings"):
        other.pop(key, None)
    for v in other["variants"]:
        v.pop("seen_data", None)
    path.write_text(json.dumps(other))
    with TestClient(build_app(reports_dir), base_url="http://127.0.0.1") as client:
        answer = client.get("/api/compare", params={"runs": "other,small"}).json()
    assert answer["problems"] == [f"other: {gate}"]
    (trace,) = answer["figures"]["summary"]["data"]
    labels = [f"{run} / {v}" for run in ("other", "small") for v in ("base", "int8", "shop-lora")]
    labels.remove("other / int8")
    assert trace["text"] == labels == [row["label"] for row in answer["rows"]]
    assert trace["x"] == [row["weight_bytes"] / 1e6 for row in answer["rows"]]
