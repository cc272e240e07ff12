"""A web page the user visits must not drive a local server (issue 23): requests with a foreign
`Origin` are refused unless allowed (`--allowed-origins`), and a loopback-bound server refuses a
`Host` that is not a loopback name (DNS rebinding) unless allowed (`--allowed-hosts`). Real HTTP
against running servers; clients that are not browsers (no Origin) are unaffected."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serve.server_util import ThreadServer, start_thread_server

BODY = {"model": "test-model", "prompt": [11, 12, 13], "max_tokens": 2, "temperature": 0}
EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[ThreadServer]:
    s = start_thread_server(model_dirs["llama"])
    yield s
    s.stop()


def test_a_foreign_origin_cannot_generate_even_with_a_simple_text_plain_post(
    server: ThreadServer,
) -> None:
    """The cross-site form / fetch(no-cors) shape: text/plain skips the CORS preflight."""
    before = server.engine.stats.num_running, server.engine.num_unfinished
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"model": "test-model", "prompt": "hi", "max_tokens": 400}',
        headers={"origin": EVIL, "content-type": "text/plain"},
    )
    assert r.status_code == 403
    error = r.json()["error"]
    assert error["code"] == "forbidden_origin"
    assert "allow it with --allowed-origins http://evil.example" in error["message"]
    assert (server.engine.stats.num_running, server.engine.num_unfinished) == before


def test_a_foreign_origin_cannot_unload_or_repoint_adapters(server: ThreadServer) -> None:
    for path, body in [
        ("/v1/unload_lora_adapter", {"lora_name": "x"}),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
    ]:
        r = httpx.post(f"{server.url}{path}", json=body, headers={"origin": EVIL})
        assert r.status_code == 403, path


def test_clients_without_an_origin_and_same_origin_pages_are_served(server: ThreadServer) -> None:
    assert httpx.post(f"{server.url}/v1/completions", json=BODY).status_code == 200
    same = httpx.post(f"{server.url}/v1/completions", json=BODY, headers={"origin": server.url})
    assert same.status_code == 200
    null = httpx.post(f"{server.url}/v1/completions", json=BODY, headers={"origin": "null"})
    assert null.status_code == 403  # sandboxed iframes and file:// pages


def test_an_allowed_origin_gets_cors_headers(model_dirs: dict[str, Path]) -> None:
    allowed = "http://localhost:3000"
    s = start_thread_server(model_dirs["llama"], allowed_origins=f"{allowed}, http://other:1")
    try:
        r = httpx.post(f"{s.url}/v1/completions", json=BODY, headers={"origin": allowed})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
        preflight = httpx.options(
            f"{s.url}/v1/completions",
            headers={
                "origin": allowed,
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type, authorization",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == allowed
        refused = httpx.post(f"{s.url}/v1/completions", json=BODY, headers={"origin": EVIL})
        assert refused.status_code == 403
    finally:
        s.stop()


def test_dns_rebinding_a_foreign_host_is_refused_on_loopback(server: ThreadServer) -> None:
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "192.168.1.5"):
        r = httpx.get(f"{server.url}/v1/models", headers={"host": host})
        assert r.status_code == 403, host
        assert "allow it with --allowed-hosts" in r.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{server.url}/v1/models", headers={"host": host}).status_code == 200


REBINDING_NAMES = ("127.0.0.1.rebind.evil.example", "127.attacker.example", "127.1", "127.0.0.1.")
"""DNS names (and non-canonical spellings) that merely start like a loopback address."""


@pytest.mark.parametrize("name", REBINDING_NAMES)
def test_host_with_loopback_prefix_is_refused(server: ThreadServer, name: str) -> None:
    """Issue 67.1: the Host check compared by prefix (`127.`), so a rebinding name starting
    with it read GET routes and drove same-origin POSTs."""
    port = server.url.rsplit(":", 1)[1]
    for host in (name, f"{name}:{port}"):
        r = httpx.get(f"{server.url}/v1/models", headers={"host": host})
        assert r.status_code == 403, host
        assert "is not a loopback name" in r.json()["error"]["message"]
        same_origin = {"host": host, "origin": f"http://{host}"}
        posted = httpx.post(f"{server.url}/v1/completions", json=BODY, headers=same_origin)
        assert posted.status_code == 403, host


def test_literal_loopback_addresses_are_accepted_as_hosts(server: ThreadServer) -> None:
    port = server.url.rsplit(":", 1)[1]
    for host in ("127.0.0.2", f"127.255.0.1:{port}", "[0:0:0:0:0:0:0:1]", "[::ffff:127.0.0.1]"):
        assert httpx.get(f"{server.url}/v1/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_and_a_non_loopback_bind_accept_other_names(
    model_dirs: dict[str, Path],
) -> None:
    proxied = start_thread_server(model_dirs["llama"], allowed_hosts="models.internal")
    public = start_thread_server(model_dirs["llama"], bind_host="0.0.0.0")
    try:
        ok = httpx.get(f"{proxied.url}/v1/models", headers={"host": "models.internal:443"})
        assert ok.status_code == 200
        assert (
            httpx.get(f"{proxied.url}/v1/models", headers={"host": "evil.example"}).status_code
            == 403
        )
        assert (
            httpx.get(f"{public.url}/v1/models", headers={"host": "evil.example"}).status_code
            == 200
        )
    finally:
        proxied.stop()
        public.stop()


def test_the_flags_are_in_serve_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "serve", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    assert "--allowed-origins" in out and "--allowed-hosts" in out and "--bind-host" not in out
