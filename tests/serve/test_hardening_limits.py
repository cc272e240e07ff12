"""Regression tests for model limits and server flags (issue 11, items 3 and 10): every bad
setting is a one-line error naming the flag, before anything is served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from serve.core.config import ModelConfig, SchedulerConfig
from serve.engine.llm_engine import LLMEngine
from serve.http.cli import API_KEY_ENV
from tests.serve.server_util import free_socket, start_thread_server, wait_healthy
from workbench.cli import main


@pytest.fixture(scope="module")
def gpt2_64(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2-style model with 64 learned positions."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2, initializer_range=0.3
    )
    out = tmp_path_factory.mktemp("gpt2-64")
    GPT2LMHeadModel(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_max_model_len_defaults_to_the_models_position_limit(gpt2_64: Path) -> None:
    s = start_thread_server(gpt2_64, max_model_len=None)
    try:
        models = httpx.get(f"{s.url}/v1/models").json()["data"]
        assert models[0]["max_model_len"] == 64
        body = {"model": "test-model", "prompt": list(range(5, 65)), "max_tokens": 8}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        ok = httpx.post(
            f"{s.url}/v1/completions",
            json={**body, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == 64
        model = GPT2LMHeadModel.from_pretrained(gpt2_64).eval()
        ids = torch.tensor([body["prompt"]])
        with torch.inference_mode():  # up to the last position the model has, exactly
            ref = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        tok = AutoTokenizer.from_pretrained(gpt2_64)
        assert ok.json()["choices"][0]["text"] == tok.decode(ref[0, 60:], skip_special_tokens=True)
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


def test_max_model_len_over_the_position_limit_is_refused(gpt2_64: Path) -> None:
    with pytest.raises(ValueError, match=r"position limit \(64 positions\).*--max-model-len 64"):
        LLMEngine(
            ModelConfig(str(gpt2_64), device="cpu"), scheduler=SchedulerConfig(max_model_len=65)
        )


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *args])
    err = capsys.readouterr().err
    code = exit_info.value.code
    # argparse prints usage + "error: ..." and exits 2; SystemExit("...") carries its message
    return code, (code if isinstance(code, str) else err.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--block-size", "0"], "argument --block-size: 0 is out of range"),
        (["--port", "99999"], "argument --port: 99999 is out of range; allowed: 0..65535"),
        (["--max-loras", "0"], "argument --max-loras: 0 is out of range"),
        (["--max-num-seqs", "-1"], "argument --max-num-seqs: -1 is out of range"),
        (["--kv-cache-memory", "0"], "not a positive size"),
        (["--kv-cache-memory", "inf"], "not a positive size"),
        (["--kv-cache-fraction", "2"], "allowed: (0, 1]"),
        (["--device", "cuda"], "CUDA is not available here"),
        (["--device", "tpu:0"], "use cpu, cuda or cuda:N"),
        (["--kv-cache-memory", "100TiB"], "give a smaller --kv-cache-memory"),
        (["--kv-cache-memory", "100000GiB"], "give a smaller --kv-cache-memory"),
        (["--max-model-len", "65"], "--max-model-len 64 or less"),
        (["--lora-root", "/no/such/dir"], "--lora-root /no/such/dir: no such directory"),
    ],
)
def test_bad_flags_are_one_line_errors(
    gpt2_64: Path, flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if flags[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, message = run_cli([str(gpt2_64), "--port", "0", "--device", "cpu", *flags], capsys)
    assert code != 0
    assert words in message, message
    assert "Traceback" not in message
    assert len(message.splitlines()) == 1, message


@pytest.mark.e2e
@pytest.mark.parametrize(
    "entry", [["workbench.cli", "serve"], ["serve"]], ids=["workbench", "serve"]
)
def test_api_key_from_the_environment(gpt2_64: Path, tmp_path: Path, entry: list[str]) -> None:
    """Through `workbench serve` and `python -m serve` alike."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", *entry, str(gpt2_64), "--port", str(port)]
    env = {**os.environ, API_KEY_ENV: "from-env"}
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([*cmd, "--device", "cpu"], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc=proc)
        assert "from-env" not in " ".join(cmd)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer from-env"})
        assert ok.status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
