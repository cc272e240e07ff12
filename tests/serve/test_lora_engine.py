"""Multi-LoRA in the engine: a mixed batch of 4 PEFT adapters and the base, each request's greedy
tokens equal to PEFT with only its adapter active; reloads and unloads between steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from serve import InvalidRequest, LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.lora.adapter import AdapterError
from serve.lora.registry import LoraConfig
from tests.serve.conftest import Case, make_cases

ADAPTERS = {
    "qv4": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
    "all8-rs": {
        "r": 8,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        "use_rslora": True,
        "lora_alpha": 16,
    },
    "mlp16": {
        "r": 16,
        "target_modules": r".*mlp\..*_proj",
        "rank_pattern": {"down_proj": 4},
        "alpha_pattern": {"down_proj": 2},
    },
    "ou2": {"r": 2, "target_modules": ["o_proj", "up_proj"], "lora_alpha": 8},
}


def make_adapter(model_dir: Path, out: Path, seed: int, **config: object) -> Path:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft = get_peft_model(base, PeftLoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # random B, but small enough that outputs move without exploding
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(model_dirs["llama"], root / name, i, **cfg)
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


def narrow_base(out: Path) -> Path:
    """A Llama half as wide as the test models: adapters made on it fit no test model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def peft_greedy(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def lora_engine(
    model_dir: Path,
    max_loras: int = 4,
    num_blocks: int = 256,
    max_rank: int = 16,
    budget: int = 256,
) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        SchedulerConfig(max_num_batched_tokens=budget),
        lora=LoraConfig(max_loras=max_loras, max_lora_rank=max_rank, max_cpu_loras=8),
    )


def with_and_without(cases: list[Case], version: int) -> list[tuple[str, list[int], int | None]]:
    """Each case twice, as request `{i}-lora` on the adapter version and `{i}-base` on none."""
    return [
        (f"{i}-{a}", c.prompt, version if a == "lora" else None)
        for i, c in enumerate(cases)
        for a in ("lora", "base")
    ]


def run_all(
    engine: LLMEngine, requests: list[tuple[str, list[int], int | None]], max_tokens: int
) -> dict[str, list[int]]:
    for rid, prompt, version in requests:
        engine.add_request(
            rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), adapter_id=version
        )
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        engine.scheduler.pool.check_integrity()
    return done


@pytest.mark.parametrize(("max_loras", "budget"), [(4, 256), (2, 1024)])
def test_mixed_batch_equals_peft_per_adapter(
    model_dirs: dict[str, Path], adapters: dict[str, Path], max_loras: int, budget: int
) -> None:
    """With max_loras=2 the scheduler must hold back requests of a third adapter; with a budget
    of 1024 the first steps exceed BATCHED_MAX_TOKENS and the layers loop over adapters."""
    model_dir = model_dirs["llama"]
    prompts = [c.prompt for c in make_cases(6, seed=11, vocab=500, max_prompt=40)]
    engine = lora_engine(model_dir, max_loras=max_loras, budget=budget)
    versions = {name: engine.load_lora(name, str(path)) for name, path in adapters.items()}
    requests, expected = [], {}
    for name in [None, *adapters]:
        reference = peft_greedy(model_dir, adapters.get(name) if name else None, prompts, 12)
        for i, p in enumerate(prompts):
            rid = f"{name}-{i}"
            requests.append((rid, p, versions[name] if name else None))
            expected[rid] = reference[i]
    interleaved = sorted(requests, key=lambda r: int(r[0].rsplit("-", 1)[1]))
    outputs = run_all(engine, interleaved, 12)
    wrong = [rid for rid in expected if outputs[rid] != expected[rid]]
    assert not wrong, (
        f"{len(wrong)} differ, e.g. {wrong[0]}: {outputs[wrong[0]]} vs {expected[wrong[0]]}"
    )
    base_outputs = [expected[f"None-{i}"] for i in range(len(prompts))]
    assert all(expected[f"qv4-{i}"] != base_outputs[i] for i in range(3)), (
        "the adapter changes nothing"
    )
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


def test_reload_and_unload_between_steps(
    model_dirs: dict[str, Path], adapters: dict[str, Path]
) -> None:
    model_dir = model_dirs["llama"]
    prompt = make_cases(1, seed=3, vocab=500, max_prompt=30)[0].prompt
    engine = lora_engine(model_dir)
    v1 = engine.load_lora("shop", str(adapters["qv4"]))
    engine.add_request(
        "old", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), adapter_id=v1
    )
    engine.step()
    v2 = engine.load_lora("shop", str(adapters["ou2"]))  # same name, new weights, mid-flight
    assert v2 != v1 and engine.adapters.resolve("shop") == v2
    engine.add_request(
        "new", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), adapter_id=v2
    )
    engine.adapters.unload("shop")
    assert engine.adapters.resolve("shop") is None and {v1, v2} <= set(engine.adapters.versions)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done["old"] == peft_greedy(model_dir, adapters["qv4"], [prompt], 10)[0]
    assert done["new"] == peft_greedy(model_dir, adapters["ou2"], [prompt], 10)[0]
    assert engine.adapters.versions == {}  # both versions dropped once their requests finished


def test_bad_adapters_are_refused_and_change_nothing(
    model_dirs: dict[str, Path], adapters: dict[str, Path], tmp_path: Path
) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    engine = lora_engine(model_dirs["llama"])
    engine.load_lora("ok", str(adapters["qv4"]))

    def variant(name: str, edit) -> Path:  # type: ignore[no-untyped-def]
        d = tmp_path / name
        shutil.copytree(adapters["qv4"], d)
        edit(d)
        return d

    def set_config(**changes: object):  # type: ignore[no-untyped-def]
        def edit(d: Path) -> None:
            cfg = json.loads((d / "adapter_config.json").read_text())
            cfg.update(changes)
            (d / "adapter_config.json").write_text(json.dumps(cfg))

        return edit

    def rename_layers(d: Path) -> None:
        tensors = load_file(d / "adapter_model.safetensors")
        save_file(
            {k.replace("layers.1.", "layers.9."): v for k, v in tensors.items()},
            d / "adapter_model.safetensors",
        )

    narrow = narrow_base(tmp_path / "narrow-base")
    cases = {
        "missing dir": (tmp_path / "nope", "no such directory"),
        "not peft": (
            variant("notpeft", lambda d: (d / "adapter_config.json").unlink()),
            "not a PEFT adapter",
        ),
        "other method": (variant("ia3", set_config(peft_type="IA3")), "only LORA adapters"),
        "pickle weights": (
            variant(
                "pickle",
                lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
            ),
            "(pickle); only adapter_model.safetensors is read",
        ),
        "corrupt": (
            variant(
                "corrupt", lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00garbage")
            ),
            "not a readable safetensors file",
        ),
        "absent module": (variant("absent", rename_layers), "which this model does not have"),
        "other base": (
            make_adapter(narrow, tmp_path / "narrow-adapter", 0, r=4, target_modules=["q_proj"]),
            "made for another base",
        ),
        "dora": (variant("dora", set_config(use_dora=True)), "use_dora=True is not supported"),
    }
    for name, (path, words) in cases.items():
        escaped = words.replace("(", r"\(").replace(")", r"\)")
        with pytest.raises(AdapterError, match=escaped):
            engine.load_lora(name, str(path))
    small = lora_engine(model_dirs["llama"], max_rank=8)
    with pytest.raises(AdapterError, match=r"rank 16 .* over the server's maximum of 8"):
        small.load_lora("big", str(adapters["mlp16"]))
    assert list(engine.adapters.current) == ["ok"] and list(engine.adapters.versions) == [1]


def test_batched_lora_rows_equal_the_per_adapter_loop() -> None:
    """Unequal adapter groups (padding), rows without an adapter, and a layer no adapter of the
    step touches: the batched path adds exactly what the per-adapter loop adds."""
    from torch import nn

    from serve.lora.layers import StepSlots, lora_step_context
    from serve.lora.slots import AdapterSlots

    torch.manual_seed(0)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.ModuleDict({"proj": nn.Linear(12, 20)})])
    manager = AdapterSlots(
        model,
        LoraConfig(max_loras=3, max_lora_rank=4, max_cpu_loras=4),
        torch.device("cpu"),
        torch.float32,
        {},
    )
    layer = manager.layers["model.layers.0.proj"]
    for slot, rank in ((1, 4), (2, 2)):
        layer.set_slot(slot, torch.randn(rank, 12), torch.randn(20, rank), 0.5)
    x = torch.randn(9, 12)
    groups = [(1, torch.tensor([0, 3, 4, 8])), (2, torch.tensor([6])), (3, torch.tensor([2]))]
    # consecutive slots in any order (read as a slice), and a gap (slots 1 and 3: copied out)
    for order, first_slot in ((groups, 1), (groups[::-1], 1), ([groups[0], groups[2]], None)):
        with lora_step_context(StepSlots(order)):
            looped = layer(x)
        batched = manager._batched_rows(order, 4, 9)
        assert batched.first_slot == first_slot
        assert batched.padding is not None and batched.covered is not None
        with lora_step_context(StepSlots(order, batched)):
            torch.testing.assert_close(layer(x), looped, rtol=1e-5, atol=1e-5)
        assert not torch.equal(looped, layer.base(x))
    assert torch.equal(layer(x), layer.base(x))  # outside a step: the base model only
    untouched = [(3, torch.tensor([0, 1]))]  # slot 3 holds nothing for this layer
    with lora_step_context(StepSlots(untouched, manager._batched_rows(untouched, 2, 9))):
        assert torch.equal(layer(x), layer.base(x))


def test_llm_takes_the_configs_and_runs_adapters_per_prompt(
    model_dirs: dict[str, Path], adapters: dict[str, Path]
) -> None:
    """`LLM(model, cache=, scheduler=, lora=, loras=)`: one prompt per adapter (and the base) in
    one call, each equal to PEFT's greedy generate."""
    from serve import LLM
    from serve.core.sampling_params import SamplingParams as Params

    model_dir = model_dirs["llama"]
    prompts = [c.prompt for c in make_cases(3, seed=5, vocab=500, max_prompt=30)]
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=128),
        lora=LoraConfig(max_loras=2, max_lora_rank=16),
        loras={"qv4": adapters["qv4"], "all8-rs": adapters["all8-rs"]},
    )
    names: list[str | None] = ["qv4", None, "all8-rs"]
    out = llm.generate(prompts, Params(max_tokens=8, temperature=0), lora=names)
    for prompt, name, completion in zip(prompts, names, out, strict=True):
        expected = peft_greedy(model_dir, adapters[name] if name else None, [prompt], 8)[0]
        assert completion.token_ids == expected, name
    with pytest.raises(InvalidRequest, match="'nope' is not loaded"):
        llm.generate(prompts[:1], lora="nope")
    assert llm.engine.scheduler.pool.num_free_blocks == llm.engine.runner.num_blocks
