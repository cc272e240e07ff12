"""The server's flags are derived from the config dataclasses: every field has a flag with its
docstring as help, and parsing builds exactly the configs (dataclass defaults where no flag)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex

import pytest

from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.http.cli import add_serve_arguments, lora_config
from serve.http.flags import attribute_docs, config_from_args
from serve.http.state import ServerSettings
from serve.lora.registry import LoraConfig

CONFIGS = (SchedulerConfig, CacheConfig, ModelConfig, LoraConfig, ServerSettings)


def parse(command_line: str) -> argparse.Namespace:
    return parser().parse_args(shlex.split(command_line))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve", exit_on_error=False)
    add_serve_arguments(p)
    return p


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_field_has_a_flag_with_its_docstring_as_help(cls: type) -> None:
    actions = {a.dest: a for a in parser()._actions}
    docs = attribute_docs(cls)
    from_process = {"bind_host": "host"}  # set from the process's own flag (--host)
    for f in dataclasses.fields(cls):
        if f.name in from_process:
            assert from_process[f.name] in actions and f.name not in actions
            continue
        assert f.name in actions, f"{cls.__name__}.{f.name} has no flag"
        assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
        if f.name != "model":  # the positional: the CLI's own help (names, .gguf, hub ids)
            help_text = (actions[f.name].help or "").replace("%%", "%")
            assert help_text.startswith(docs[f.name]), f.name


def test_no_flags_give_the_dataclass_defaults() -> None:
    args = parser().parse_args(["m"])
    assert config_from_args(SchedulerConfig, args) == SchedulerConfig()
    assert config_from_args(CacheConfig, args) == CacheConfig()
    assert config_from_args(ModelConfig, args, model="m") == ModelConfig("m")
    assert config_from_args(ServerSettings, args, model_name="x") == ServerSettings("x")
    assert lora_config(args) is None  # LoRA serving stays off


def test_flags_build_the_configs() -> None:
    args = parse(
        "m --block-size 16 --kv-cache-memory 1MiB --kv-cache-fraction 0.25 --num-blocks 9 "
        "--kv-cache-dtype int8 "
        "--max-num-seqs 3 --max-model-len 100 --no-enable-prefix-caching --dtype bfloat16 "
        "--attention-backend sdpa --no-prepack-linears --compile --max-lora-rank 8 "
        "--max-waiting 5 --max-body-bytes 2KiB --allow-any-lora-path"
    )
    assert config_from_args(CacheConfig, args) == CacheConfig(16, 1 << 20, 0.25, 9, "int8")
    assert config_from_args(SchedulerConfig, args) == SchedulerConfig(3, 1024, 100, False)
    assert config_from_args(ModelConfig, args, model="m") == ModelConfig(
        "m", "bfloat16", "auto", "sdpa", prepack_linears=False, compile=True
    )
    assert lora_config(args) == LoraConfig(max_lora_rank=8)  # a LoRA flag turns LoRA on
    settings = config_from_args(ServerSettings, args, model_name="x")
    assert (settings.max_waiting, settings.max_body_bytes) == (5, 2048)
    assert settings.allow_any_lora_path is True


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--block-size 2000", "2000 is out of range; allowed: 1..1024"),
        ("--kv-cache-fraction 0", "0.0 is out of range; allowed: (0, 1]"),
        ("--max-cpu-loras 0", "0 is out of range; allowed: >= 1"),
        ("--max-num-seqs x", "'x' is not an integer"),
        ("--dtype float8", "invalid choice: 'float8'"),
        ("--kv-cache-dtype fp8", "invalid choice: 'fp8'"),
    ],
)
def test_bounds_come_from_the_configs(flags: str, message: str) -> None:
    with pytest.raises(
        argparse.ArgumentError, match=message.replace("(", r"\(").replace("]", r"\]")
    ):
        parser().parse_args(["m", *flags.split()])


def test_a_config_built_in_python_is_checked_against_the_same_bounds() -> None:
    with pytest.raises(ValueError, match=r"block_size is 2000; allowed: 1\.\.1024"):
        CacheConfig(block_size=2000)
    with pytest.raises(ValueError, match="max_loras is 0; allowed: >= 1"):
        LoraConfig(max_loras=0)
