"""Adapters over HTTP: load, select by model name, hot reload and unload under load, refusals."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve import SamplingParams
from serve.lora.registry import LoraConfig
from tests.serve.conftest import make_cases
from tests.serve.server_util import ThreadServer, start_thread_server
from tests.serve.test_lora_engine import ADAPTERS, lora_engine, make_adapter, narrow_base


@pytest.fixture(scope="module")
def adapter_root(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-root")
    for i, name in enumerate(["qv4", "ou2"]):
        make_adapter(model_dirs["llama"], root / name, i, **ADAPTERS[name])
    return root


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], adapter_root: Path) -> Iterator[ThreadServer]:
    s = start_thread_server(
        model_dirs["llama"],
        lora=LoraConfig(max_loras=4, max_lora_rank=16),
        max_waiting=1000,
        lora_root=adapter_root,
    )
    yield s
    s.stop()


def post(server: ThreadServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def expected_outputs(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[str]:
    engine = lora_engine(model_dir)
    version = engine.load_lora("x", str(adapter)) if adapter else None
    for i, p in enumerate(prompts):
        engine.add_request(
            str(i),
            p,
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            adapter_id=version,
        )
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.text for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def test_load_select_and_list_adapters(
    server: ThreadServer, model_dirs: dict[str, Path], adapter_root: Path
) -> None:
    r = post(
        server,
        "/v1/load_lora_adapter",
        {"lora_name": "qv4", "lora_path": str(adapter_root / "qv4")},
    )
    assert r.status_code == 200 and r.json()["status"] == "loaded", r.text
    models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert models["qv4"]["parent"] == "test-model" and models["test-model"]["parent"] is None
    prompts = [c.prompt for c in make_cases(3, seed=21, vocab=500, max_prompt=30)]
    want = expected_outputs(model_dirs["llama"], adapter_root / "qv4", prompts, 10)
    base = expected_outputs(model_dirs["llama"], None, prompts, 10)
    for p, w, b in zip(prompts, want, base):
        body = {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        assert (
            post(server, "/v1/completions", {**body, "model": "qv4"}).json()["choices"][0]["text"]
            == w
        )
        assert (
            post(server, "/v1/completions", {**body, "model": "test-model"}).json()["choices"][0][
                "text"
            ]
            == b
        )
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'workbench:lora_requests_total{adapter="qv4",model_name="test-model"} 3.0' in metrics
    assert "workbench:lora_load_seconds_count" in metrics


async def _stream(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int]
) -> tuple[int, str]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = ""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return 200, text


async def _admitted(client: httpx.AsyncClient, url: str, adapter: str, n: int) -> None:
    """Wait until the server has admitted `n` requests on `adapter` (its lora_requests counter:
    an admitted request is queued to the engine thread ahead of any later load or unload)."""
    pattern = re.compile(rf'workbench:lora_requests_total{{adapter="{adapter}",[^}}]*}} (\S+)')
    for _ in range(600):
        found = pattern.search((await client.get(f"{url}/metrics")).text)
        if found and float(found.group(1)) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{n} requests on {adapter} were not admitted within 30 s")


def test_hot_reload_and_unload_under_100_streams(
    server: ThreadServer, model_dirs: dict[str, Path], adapter_root: Path
) -> None:
    prompts = [c.prompt for c in make_cases(100, seed=8, vocab=500, max_prompt=24)]
    old = expected_outputs(model_dirs["llama"], adapter_root / "qv4", prompts, 30)
    new = expected_outputs(model_dirs["llama"], adapter_root / "ou2", prompts, 30)
    url = server.url

    async def scenario() -> tuple[list, list, list]:
        async with httpx.AsyncClient(
            timeout=300, limits=httpx.Limits(max_connections=200)
        ) as client:
            await client.post(
                f"{url}/v1/load_lora_adapter",
                json={"lora_name": "shop", "lora_path": str(adapter_root / "qv4")},
            )
            first = [asyncio.ensure_future(_stream(client, url, "shop", p)) for p in prompts[:50]]
            await _admitted(client, url, "shop", 50)  # the first wave is in
            reload = await client.post(
                f"{url}/v1/load_lora_adapter",
                json={"lora_name": "shop", "lora_path": str(adapter_root / "ou2")},
            )
            assert reload.status_code == 200
            second = [asyncio.ensure_future(_stream(client, url, "shop", p)) for p in prompts[50:]]
            await _admitted(client, url, "shop", 100)
            unload = await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "shop"})
            assert unload.status_code == 200
            late = await _stream(client, url, "shop", prompts[0])
            return await asyncio.gather(*first), await asyncio.gather(*second), [late]

    first, second, (late,) = asyncio.run(scenario())
    assert [s for s, _ in first + second] == [200] * 100
    assert [t for _, t in first] == old[:50], (
        "a request that started on the old adapter changed weights"
    )
    assert [t for _, t in second] == new[50:]
    assert late[0] == 404 and "does not exist" in late[1]
    engine = server.engine.engine
    assert engine.adapters.versions.keys() <= {v for v in engine.adapters.current.values()}
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


def test_bad_adapters_get_400_and_the_server_keeps_serving(
    server: ThreadServer, adapter_root: Path, tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    def copy(name: str) -> Path:
        d = adapter_root / name
        if not d.exists():
            shutil.copytree(adapter_root / "qv4", d)
        return d

    (copy("pickle") / "adapter_model.safetensors").rename(
        adapter_root / "pickle" / "adapter_model.bin"
    )
    (copy("corrupt") / "adapter_model.safetensors").write_bytes(b"\x00not safetensors")
    (copy("notpeft") / "adapter_config.json").unlink()
    config = json.loads((adapter_root / "qv4" / "adapter_config.json").read_text())
    (copy("ia3") / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    make_adapter(
        narrow_base(tmp_path / "narrow"), adapter_root / "narrow", 0, r=4, target_modules=["q_proj"]
    )
    make_adapter(model_dirs["llama"], adapter_root / "rank32", 0, r=32, target_modules=["q_proj"])
    (adapter_root / "escape").symlink_to(tmp_path)
    cases = [
        ({"lora_name": "a", "lora_path": str(adapter_root / "missing")}, 400, "no such directory"),
        ({"lora_name": "a", "lora_path": str(adapter_root / "notpeft")}, 400, "not a PEFT adapter"),
        ({"lora_name": "a", "lora_path": str(adapter_root / "ia3")}, 400, "only LORA adapters"),
        ({"lora_name": "a", "lora_path": str(adapter_root / "pickle")}, 400, "(pickle)"),
        (
            {"lora_name": "a", "lora_path": str(adapter_root / "corrupt")},
            400,
            "not a readable safetensors",
        ),
        (
            {"lora_name": "a", "lora_path": str(adapter_root / "narrow")},
            400,
            "made for another base",
        ),
        (
            {"lora_name": "a", "lora_path": str(adapter_root / "rank32")},
            400,
            "over the server's maximum of 16",
        ),
        (
            {"lora_name": "a", "lora_path": str(adapter_root / ".." / "qv4")},
            400,
            "outside the adapter root",
        ),
        (
            {"lora_name": "a", "lora_path": str(adapter_root / "escape" / "x")},
            400,
            "outside the adapter root",
        ),
        (
            {"lora_name": "test-model", "lora_path": str(adapter_root / "qv4")},
            400,
            "base model's name",
        ),
        ({"lora_name": "a"}, 400, "missing required field 'lora_path'"),
    ]
    for body, status, words in cases:
        r = post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404
    assert "a" not in [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    ok = post(server, "/v1/completions", {"model": "test-model", "prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200


def test_adapter_routes_need_the_api_key(model_dirs: dict[str, Path], adapter_root: Path) -> None:
    s = start_thread_server(
        model_dirs["llama"], lora=LoraConfig(), api_key="k", lora_root=adapter_root
    )
    try:
        body = {"lora_name": "x", "lora_path": str(adapter_root / "qv4")}
        assert httpx.post(f"{s.url}/v1/load_lora_adapter", json=body).status_code == 401
        ok = httpx.post(
            f"{s.url}/v1/load_lora_adapter",
            json=body,
            headers={"authorization": "Bearer k"},
            timeout=60,
        )
        assert ok.status_code == 200
        assert (
            httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code
            == 401
        )
    finally:
        s.stop()


@pytest.mark.e2e
def test_cli_loads_adapters_at_start_and_refuses_bad_ones(
    model_dirs: dict[str, Path], adapter_root: Path, tmp_path: Path
) -> None:
    import subprocess
    import sys

    from tests.serve.server_util import start_subprocess_server

    proc, url = start_subprocess_server(
        model_dirs["llama"], tmp_path / "ok.log", "--lora", f"shop={adapter_root / 'qv4'}"
    )
    try:
        ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert ids == ["test-model", "shop"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            str(model_dirs["llama"]),
            "--device",
            "cpu",
            "--lora",
            f"x={tmp_path / 'missing'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--lora x=" in bad.stderr and "no such directory" in bad.stderr


class ThreadRecordingDict(OrderedDict):
    """An adapter table that notes which thread touches it."""

    def __init__(self, *args: object) -> None:
        self.threads: set[str] = set()
        super().__init__(*args)
        self.threads.clear()  # the copy above ran on the test's thread

    def _note(self) -> None:
        self.threads.add(threading.current_thread().name)


for _name in (
    "__iter__",
    "__getitem__",
    "__contains__",
    "__len__",
    "__setitem__",
    "__delitem__",
    "move_to_end",
    "get",
    "pop",
    "keys",
    "values",
    "items",
):

    def _recording(self: ThreadRecordingDict, *a: object, _m: str = _name, **k: object) -> object:
        self._note()
        return getattr(OrderedDict, _m)(self, *a, **k)

    setattr(ThreadRecordingDict, _name, _recording)


def test_adapter_table_is_touched_only_on_the_engine_thread_under_races(
    server: ThreadServer, adapter_root: Path
) -> None:
    """Loads, unloads, listings and adapter requests race; coroutines never touch the engine's
    adapter table (each request reorders it on the engine thread), listings stay consistent."""
    manager = server.engine.engine.adapters
    for name in ("race-a", "race-b"):
        r = post(
            server,
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(adapter_root / "qv4")},
        )
        assert r.status_code == 200, r.text
    table = ThreadRecordingDict(manager.current)
    manager.current = table
    prompts = [c.prompt for c in make_cases(24, seed=5, vocab=500, max_prompt=16)]
    url = server.url

    async def churn(client: httpx.AsyncClient) -> list[int]:
        codes = []
        for _ in range(6):
            for path, body in (
                (
                    "/v1/load_lora_adapter",
                    {"lora_name": "race-c", "lora_path": str(adapter_root / "ou2")},
                ),
                ("/v1/unload_lora_adapter", {"lora_name": "race-c"}),
            ):
                codes.append((await client.post(f"{url}{path}", json=body)).status_code)
        return codes

    async def listings(client: httpx.AsyncClient) -> list[set[str]]:
        seen = []
        for _ in range(30):
            ids = {m["id"] for m in (await client.get(f"{url}/v1/models")).json()["data"]}
            seen.append(ids)
            await asyncio.sleep(0.01)
        return seen

    async def scenario() -> tuple[list, list[int], list[set[str]]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as c:
            streams = [
                asyncio.ensure_future(_stream(c, url, ("race-a", "race-b")[i % 2], p))
                for i, p in enumerate(prompts)
            ]
            codes, seen = await asyncio.gather(churn(c), listings(c))
            return await asyncio.gather(*streams), codes, seen

    outputs, codes, seen = asyncio.run(scenario())
    assert [status for status, _ in outputs] == [200] * len(prompts)
    assert codes == [200] * len(codes)
    assert all({"race-a", "race-b"} <= ids for ids in seen)
    assert len({frozenset(ids - {"race-c"}) for ids in seen}) == 1
    assert table.threads == {"engine"}, f"the adapter table was touched from {table.threads}"
    engine = server.engine.engine
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks
    for name in ("race-a", "race-b"):
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
