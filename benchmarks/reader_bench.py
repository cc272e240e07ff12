"""What streaming clients that never read cost the server (issue 23: two of them, n = 8, 3,000
tokens, logprobs 5, grew a server by 550 MB in 23 s).

`python -m benchmarks.reader_bench [--model DIR] [--clients 2] [--n 8] [--max-tokens 3000]
[--seconds 23] [-- SERVER FLAGS]`: starts `python -m serve` on the model (a process of its own,
so its memory is its own), reads its resident memory, opens the streams over raw sockets whose
receive buffers are small and never read from them, and after `--seconds` reads the server's
resident memory again and its finished-request counts by reason. Works against any version of
the server (it only speaks HTTP), so a baseline is a checkout of the older code.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from catalog import ensure_demo_model


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(model: Path, port: int, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serve", str(model), "--port", str(port), "--served-model-name"]
    cmd += ["m", "--dtype", "float32", "--device", "cpu", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def never_read(port: int, body: dict) -> socket.socket:
    """A client that sends a streaming request and then reads nothing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    s.sendall(head.encode() + payload)
    return s


def finished_by_reason(port: int) -> dict[str, float]:
    """Finished requests by reason, and "generated": the tokens generated so far."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("workbench:generation_tokens_total{"):
            out["generated"] = float(line.rsplit(" ", 1)[1])
        if line.startswith(("workbench:request_success_total{", "vllm:request_success_total{")):
            reason = line.split('finished_reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="model dir (default: the tiny demo model)")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=23)
    args, flags = parser.parse_known_args(argv)
    flags = [f for f in flags if f != "--"]
    args.model = args.model or ensure_demo_model("demo-tiny")
    port = free_port()
    proc = start(args.model, port, ["--max-model-len", str(args.max_tokens + 16), *flags])
    try:
        before = rss_mb(proc.pid)
        body = {
            "model": "m",
            "prompt": [11, 12, 13],
            "max_tokens": args.max_tokens,
            "n": args.n,
            "logprobs": args.logprobs,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        clients = [never_read(port, body) for _ in range(args.clients)]
        peak = before
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            peak = max(peak, rss_mb(proc.pid))
            time.sleep(0.25)
        after = rss_mb(proc.pid)
        reasons = finished_by_reason(port)
        print(
            f"server RSS {before:.0f} MB before, {after:.0f} MB after {args.seconds:g} s "
            f"(peak {peak:.0f} MB, +{peak - before:.0f} MB) with {args.clients} streams of "
            f"n={args.n} x {args.max_tokens} tokens (logprobs {args.logprobs}) never read; "
            f"finished requests by reason: {reasons or 'none'}; flags: {' '.join(flags) or '-'}"
        )
        for c in clients:
            c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
