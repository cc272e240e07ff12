"""Regression tests for adapters that used to kill, freeze or fool the server (issue 11, items
11-15): each bad adapter gets a 4xx at load time, the engine never sees it, and the server
answers the same greedy text afterwards."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.artifact import MANIFEST
from serve.lora.registry import LoraConfig
from tests.serve.server_util import ThreadServer, start_thread_server
from tests.serve.test_lora_engine import ADAPTERS, make_adapter
from tests.serve.test_server import metrics

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
BASE = {"model": "test-model", "prompt": [21, 22, 23], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def good(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good adapter, outside the server's root."""
    return make_adapter(
        model_dirs["llama"], tmp_path_factory.mktemp("outside") / "qv4", 0, **ADAPTERS["qv4"]
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-root")


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], root: Path) -> Iterator[ThreadServer]:
    s = start_thread_server(
        model_dirs["llama"],
        lora=LoraConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2),
        lora_root=root,
    )
    yield s
    s.stop()


def load(s: ThreadServer, name: str, path: str, **extra: object) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path, **extra}
    return httpx.post(f"{s.url}/v1/load_lora_adapter", json=body, timeout=60)


def unload(s: ThreadServer, name: str) -> httpx.Response:
    return httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def text(s: ThreadServer, model: str = "test-model") -> str:
    r = httpx.post(f"{s.url}/v1/completions", json={**BASE, "model": model}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def variant(good: Path, root: Path, name: str, edit: Callable[[Path], None]) -> Path:
    """A copy of the good adapter inside the root, broken by `edit`."""
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(good, out)
    edit(out)
    return out


def set_config(**changes: object) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        config = json.loads((path / CONFIG).read_text())
        config.update(changes)
        (path / CONFIG).write_text(json.dumps(config))  # NaN is written as NaN, as Python does

    return edit


def write_config(raw: str) -> Callable[[Path], None]:
    return lambda path: (path / CONFIG).write_text(raw)


def write_manifest(raw: str | bytes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        file = path / MANIFEST
        file.write_bytes(raw) if isinstance(raw, bytes) else file.write_text(raw)

    return edit


def manifest_dir(path: Path) -> None:
    (path / MANIFEST).unlink(missing_ok=True)
    (path / MANIFEST).mkdir()


def set_tensor(change: Callable[[str, torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        tensors = load_file(str(path / WEIGHTS))
        save_file({k: change(k, v).contiguous() for k, v in tensors.items()}, str(path / WEIGHTS))

    return edit


def first_a(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    state = {"done": False}

    def change(key: str, tensor: torch.Tensor) -> torch.Tensor:
        if "lora_A" in key and not state["done"]:
            state["done"] = True
            return fn(tensor)
        return tensor

    return change


def with_value(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[0, 0] = value
        return t

    return fn


BAD = {
    # 11: loaded with 200, then killed the engine at first use
    "lora_alpha_1e308": (set_config(lora_alpha=1e308), "cannot hold"),
    "lora_a_3d": (set_tensor(first_a(lambda t: t[None])), "2-D"),
    "nan_weight": (set_tensor(first_a(with_value(float("nan")))), "NaN or infinite"),
    "inf_weight": (set_tensor(first_a(with_value(float("inf")))), "NaN or infinite"),
    "lora_alpha_nan": (set_config(lora_alpha=float("nan")), "lora_alpha is nan"),
    # 13: 500 instead of 400
    "config_is_a_list": (write_config("[1, 2]"), "not an object"),
    "config_is_a_string": (write_config('"LORA"'), "not an object"),
    "r_zero": (set_config(r=0), "r is 0"),
    "r_string": (set_config(r="8"), "r is '8'"),
    "lora_alpha_string": (set_config(lora_alpha="16"), "lora_alpha is '16'"),
    "negative_r_with_rslora": (set_config(r=-4, use_rslora=True), "r is -4"),
    "invalid_regex": (set_config(rank_pattern={"q_proj[": 4}), "not a valid regex"),
    "rank_pattern_list": (set_config(rank_pattern=["q_proj"]), "rank_pattern is a list"),
    "zero_d_tensor": (set_tensor(first_a(lambda t: t[0, 0])), "2-D"),
    # 23: 500 instead of 400, an adapter's workbench.json that is no manifest
    "manifest_is_a_number": (write_manifest("5"), "not a workbench manifest"),
    "manifest_is_a_string": (write_manifest('"files"'), "found str"),
    "manifest_is_a_list": (write_manifest('["files"]'), "found list"),
    "manifest_is_a_directory": (manifest_dir, "not a workbench manifest"),
    "manifest_not_utf8": (write_manifest(b"\xff\xfe{"), "not a workbench manifest"),
    # 12: a regex that no engine matches in bounded time
    "catastrophic_pattern": (set_config(rank_pattern={"(.*){1,32000}[bc]": 4}), "took over"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_refused_at_load_and_the_engine_is_untouched(
    server: ThreadServer, good: Path, root: Path, case: str
) -> None:
    before = text(server)
    edit, words = BAD[case]
    r = load(server, case.replace("_", "-"), str(variant(good, root, case, edit)))
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()
    assert case.replace("_", "-") not in [
        m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]
    ]
    assert text(server) == before
    assert server.engine.healthy


def test_rank_pattern_from_the_issue_does_not_freeze_the_server(
    server: ThreadServer, good: Path, root: Path
) -> None:
    path = variant(good, root, "redos", set_config(rank_pattern={"(.|.)*Z": 2}))
    result: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: result.append(load(server, "redos", str(path))))
    worker.start()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    worker.join(30)
    assert result and result[0].status_code == 200  # the key matches no module: default rank
    assert unload(server, "redos").status_code == 200


@pytest.mark.parametrize(
    ("path", "words"),
    [("a\x00b", "NUL"), ("x" * 100_000, "at most 4096"), ("~nosuchuser/x", "not a usable path")],
)
def test_odd_lora_paths_get_400(server: ThreadServer, path: str, words: str) -> None:
    r = load(server, "odd", path)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_symlinked_files_cannot_escape_the_lora_root(
    server: ThreadServer, good: Path, root: Path
) -> None:
    links = root / "links"
    links.mkdir(exist_ok=True)
    for name in (CONFIG, WEIGHTS):
        (links / name).unlink(missing_ok=True)
        (links / name).symlink_to(good / name)
    r = load(server, "links", str(links))
    assert r.status_code == 400 and "outside the adapter root" in r.json()["error"]["message"]
    system = root / "system-config"
    system.mkdir(exist_ok=True)
    (system / CONFIG).unlink(missing_ok=True)
    (system / CONFIG).symlink_to("/etc/hostname")
    r = load(server, "system", str(system))
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "outside the adapter root" in message  # refused unread
    assert "not valid JSON" not in message


def test_loading_over_http_without_a_root_is_an_explicit_opt_in(
    model_dirs: dict[str, Path], good: Path
) -> None:
    closed = start_thread_server(model_dirs["llama"], lora=LoraConfig())
    try:
        r = load(closed, "qv4", str(good))
        assert r.status_code == 403 and "--lora-root" in r.json()["error"]["message"]
    finally:
        closed.stop()
    opened = start_thread_server(model_dirs["llama"], lora=LoraConfig(), allow_any_lora_path=True)
    try:
        assert load(opened, "qv4", str(good)).status_code == 200
        assert text(opened, "qv4") != text(opened)
    finally:
        opened.stop()


def test_loading_past_max_cpu_loras_is_refused_unless_evict_is_asked(
    server: ThreadServer, good: Path, root: Path
) -> None:
    for name in ("a", "b", "c"):
        variant(good, root, name, lambda p: None)
    assert load(server, "a", str(root / "a")).status_code == 200
    assert load(server, "b", str(root / "b")).status_code == 200
    text(server, "a")  # a is now the most recently used
    r = load(server, "c", str(root / "c"))
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_limit", r.text
    listed = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert listed[1:] == ["b", "a"]
    assert load(server, "a", str(root / "a")).status_code == 200  # a reload needs no room
    r = load(server, "c", str(root / "c"), evict=True)
    assert r.status_code == 200 and r.json()["evicted"] == ["b"], r.text
    assert sorted(m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]) == [
        "a",
        "c",
        "test-model",
    ]
    labels = [
        k
        for k in httpx.get(f"{server.url}/metrics").text.splitlines()
        if "lora_requests_total{" in k
    ]
    assert not any('adapter="b"' in line for line in labels)
    assert any('adapter="a"' in line for line in labels)
    for name in ("a", "c"):
        assert unload(server, name).status_code == 200
    assert metrics(server.url)["workbench:lora_loaded_adapters"] == 0


def test_racing_unloads_answer_one_200_and_one_404(
    server: ThreadServer, good: Path, root: Path
) -> None:
    variant(good, root, "race", lambda p: None)
    for _ in range(5):
        assert load(server, "race", str(root / "race")).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = sorted(pool.map(lambda _: unload(server, "race").status_code, range(4)))
        assert codes == [200, 404, 404, 404]


def test_adapter_dir_link_inside_root_to_outside_is_refused(
    server: ThreadServer, good: Path, root: Path
) -> None:
    link = root / "dir-link"
    if not link.exists():
        os.symlink(good, link)
    r = load(server, "dir-link", str(link))
    assert r.status_code == 400 and "outside the adapter root" in r.json()["error"]["message"]
