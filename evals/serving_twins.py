"""Serving twins: variants whose load figures are one measurement.

Model: the load ramp sends seeded random token ids, greedy, with `ignore_eos` and exact output
lengths, so what it measures depends on the served computation's shapes and formats, not on the
weights' values. Two model variants with the same config.json (its quantization config
included), the same load spec and the same `serve:` settings do the same work in every step, as
do two adapters of the same shape (rank, alpha, targets) on the same base and settings. The
recipe's later twin takes the earlier one's load result (`LoadResult.measured_on` names it)
instead of ramping a server of its own; chat answers and the server check stay per variant.
Not twins: bitsandbytes int8 with an outlier threshold, whose float path takes the columns the
activations make outliers (data-dependent work).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from compress.load_spec import read_load_spec
from evals.variant import VariantResult

NAME_FIELDS = {"_name_or_path", "name_or_path", "transformers_version"}
"""config.json fields that name the checkpoint rather than describe the computation."""
ADAPTER_NAME_FIELDS = {"base_model_name_or_path", "revision", "peft_version"}


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _value_dependent(quantization: dict[str, Any] | None) -> bool:
    q = quantization or {}
    return bool(
        q.get("quant_method") == "bitsandbytes"
        and q.get("load_in_8bit")
        and float(q.get("llm_int8_threshold", 0.0)) > 0
    )


def serving_signature(variant: VariantResult, model_path: Path) -> str | None:
    """What the variant's load figures depend on, as a hash (None: its own figures only).
    `model_path` is the model its server loads (an adapter's: its base)."""
    config_file = model_path / "config.json"
    if not config_file.is_file():
        return None
    config = {k: v for k, v in _json(config_file).items() if k not in NAME_FIELDS}
    if _value_dependent(config.get("quantization_config")):
        return None
    spec = read_load_spec(model_path)
    parts: dict[str, Any] = {
        "config": config,
        "format": spec.format,
        "scheme": spec.scheme,
        "params": spec.params,
        "serve": variant.serve.key(),
    }
    if variant.manifest.kind == "adapter":
        adapter_config = variant.path / "adapter_config.json"
        if not adapter_config.is_file():
            return None
        adapter = _json(adapter_config)
        parts["base"] = str(model_path.resolve())
        parts["adapter"] = {k: v for k, v in adapter.items() if k not in ADAPTER_NAME_FIELDS}
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
