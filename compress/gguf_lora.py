"""Exporting a LoRA adapter as a GGUF LoRA file, the adapter format llama.cpp loads
(`llama-cli -m base.gguf --lora adapter.gguf`, `Llama(model_path, lora_path=...)`).

Model: llama.cpp adds `scale * B (A x)` to each adapted weight's output, with `scale =
adapter.lora.alpha / r` (r: the tensor's rank) times the user's `--lora-scaled` factor; the file
holds, per adapted weight, `<gguf weight name>.lora_a` (A, [r, in]) and `.lora_b` (B, [out, r]),
under `general.type = adapter`, `adapter.type = lora`. PEFT's scaling per module (`lora_alpha /
r`, `rank_pattern`, `alpha_pattern`, rsLoRA's `/ sqrt(r)`), read from PEFT itself on the base's
architecture, is written as the file's alpha (the config's `lora_alpha`) with whatever differs
from `alpha / r` folded into B, so one alpha serves every module; a plain adapter's B is written
as it is (what llama.cpp's own `convert_lora_to_gguf.py` writes). Llama's q/k rows are permuted
as the base export permutes its weights (B's rows: `W + B A` permuted is `W' + B' A`).
Refused, naming why: DoRA, trained biases, `modules_to_save`, an embedding or head adapter
(llama.cpp's converter refuses them too), an architecture the base exporter does not write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from compress.gguf_export import ARCHITECTURES, GgufExportError, add_tensor, finish, permuted

LORA_TYPES = ("f32", "f16", "bf16", "q8_0")
"""What llama.cpp's converter writes adapters in."""
LORA_FILE = "adapter.gguf"
WEIGHTS = "adapter_model.safetensors"


def peft_scalings(adapter: Path, base: Path) -> dict[str, float]:
    """{module name: the scaling PEFT applies to its B A}, from PEFT's own layers injected into
    the base's architecture on the meta device (no weights read)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    lora = LoraConfig.from_pretrained(str(adapter))
    config = AutoConfig.from_pretrained(base)
    config.quantization_config = None  # the architecture only (a QLoRA base is bitsandbytes)
    with torch.device("meta"):
        model = inject_adapter_in_model(lora, AutoModelForCausalLM.from_config(config))
    return {
        name: float(module.scaling["default"])
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


def _checked_config(adapter: Path) -> Any:
    from peft import LoraConfig

    lora = LoraConfig.from_pretrained(str(adapter))
    if getattr(lora, "use_dora", False):
        raise GgufExportError(f"{adapter}: a DoRA adapter cannot be written as GGUF LoRA")
    if lora.bias != "none":
        raise GgufExportError(
            f"{adapter}: trains biases (bias={lora.bias!r}), which GGUF LoRA cannot hold; merge "
            "it into the base (a `merge` step) and export the merged model"
        )
    if lora.modules_to_save:
        raise GgufExportError(
            f"{adapter}: modules_to_save {sorted(lora.modules_to_save)} are full weights, not "
            "LoRA; merge the adapter and export the merged model"
        )
    return lora


def _pairs(adapter: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {"A": [r, in], "B": [out, r]}} from the adapter's safetensors."""
    from safetensors.torch import load_file

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(adapter / WEIGHTS)).items():
        module, _, rest = key.removeprefix("base_model.model.").partition(".lora_")
        which = rest[:1]
        if which not in ("A", "B") or not rest.endswith("weight"):
            raise GgufExportError(
                f"{adapter / WEIGHTS}: {key!r} is not a LoRA A or B matrix (an embedding "
                "adapter?); GGUF LoRA holds linear layers' A and B only"
            )
        pairs.setdefault(module, {})[which] = tensor.float()
    return pairs


def write_gguf_lora(adapter: Path, base: Path, gguf_type: str, out_file: Path) -> dict[str, int]:
    """Write the PEFT adapter at `adapter` (trained on the model at `base`) as a GGUF LoRA file
    of `gguf_type`; returns the tensor count per GGML type."""
    import gguf
    from transformers import AutoConfig

    if gguf_type not in LORA_TYPES:
        raise GgufExportError(
            f"--gguf-type: found {gguf_type!r}; an adapter is written in {', '.join(LORA_TYPES)}"
        )
    config = AutoConfig.from_pretrained(base).get_text_config()
    if config.model_type not in ARCHITECTURES:
        raise GgufExportError(
            f"{adapter}: its base is a {config.model_type} model; GGUF LoRA is written for "
            f"{', '.join(ARCHITECTURES)} bases"
        )
    lora = _checked_config(adapter)
    scalings = peft_scalings(adapter, base)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[config.model_type.upper()],
                                     config.num_hidden_layers)  # fmt: skip
    alpha = float(lora.lora_alpha)
    writer = gguf.GGUFWriter(str(out_file), config.model_type)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_name("workbench adapter export")
    counts: dict[str, int] = {}
    for module, ab in sorted(_pairs(adapter).items()):
        name = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if name is None or module not in scalings or set(ab) != {"A", "B"}:
            raise GgufExportError(
                f"{adapter}: module {module!r} has no GGUF weight to adapt (only the linear "
                "layers of the decoder blocks are); retrain without it"
            )
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        factor = scalings[module] * rank / alpha if alpha else scalings[module]
        b = permuted(f"{module}.weight", b * factor if factor != 1.0 else b, config)
        add_tensor(gguf, writer, f"{name}.lora_a", a, gguf_type, counts)
        add_tensor(gguf, writer, f"{name}.lora_b", b, gguf_type, counts)
    finish(writer)
    return counts
