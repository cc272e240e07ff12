"""int4-wo's torchao weights as the engine's int4 linears.

Model: the `int4-wo` method stores a bfloat16 checkpoint that torchao quantizes as it loads
(each linear's weight an `Int4OpaqueTensor`: the codes in the CPU int4 kernel's layout and its
bfloat16 scales and zeros). `adopt_torchao_int4` puts a `compress.packed.PackedLinear4` over the
same tensors in place of each such linear, so the calls that `dequantize_rows` sends to the
dequantized product take it (see `compress.packed`); `transplant_int4` moves those linears into
the same model loaded in another dtype, so a float32 load of int4-wo is float32 everywhere but
in its int4 products; `int4_onto` puts the model on a GPU, its int4 linears as tinygemm's
(`compress.packed_cuda`) over the same codes and bfloat16 scales and offsets.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.packed import PackedLinear4
from compress.packed_cuda import TinygemmLinear4, tinygemm_runs


def adopt_torchao_int4(model: nn.Module) -> int:
    """Replace each CPU linear whose weight is torchao's `Int4OpaqueTensor` (the `int4-wo`
    method) by a `PackedLinear4` over the same tensors, so calls of `dequantize_rows` rows or
    more take the dequantized product (about twice the kernel's speed there: see
    `compress.packed`) and smaller ones the same kernel as torchao's; returns how many."""
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor

    replaced = 0
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or not isinstance(weight, Int4OpaqueTensor):
            continue
        plain = weight.act_pre_scale is None and weight.act_mapping_type is None
        if not plain or weight.block_size[0] != 1 or weight.qdata.device.type != "cpu":
            continue
        linear = PackedLinear4.from_kernel_tensors(
            weight.qdata,
            weight.scale_and_zero,
            module.bias,
            (module.out_features, module.in_features),
        )
        if linear is None:
            continue
        model.set_submodule(name, linear)
        replaced += 1
    return replaced


def transplant_int4(source: nn.Module, target: nn.Module, dtype: torch.dtype) -> None:
    """Puts `source`'s int4 linears (its `PackedLinear4`s, biases cast to `dtype`) into `target`
    in place of its modules of the same names: `target` is the same model loaded in `dtype`, so
    everything else (embedding, head, norms, the rotary frequencies computed at init) is what a
    load in `dtype` gives, and the products read the same codes and bfloat16 kernel scales.
    ValueError where `source` still has a torchao int4 weight that could not be adopted: its
    kernel needs bfloat16 activations."""
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor

    for name, module in list(source.named_modules()):
        if isinstance(getattr(module, "weight", None), Int4OpaqueTensor):
            raise ValueError(
                f"{name}: a torchao int4 weight whose layout this torch build cannot read back "
                "computes in bfloat16 only; load this model in bfloat16"
            )
        if isinstance(module, PackedLinear4):
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
            target.set_submodule(name, module)


def int4_onto(model: nn.Module, device: torch.device) -> nn.Module:
    """int4-wo's model (loaded on the CPU) on `device`: on a GPU each int4 linear becomes a
    `TinygemmLinear4` over the same codes and kernel scales (`to_tinygemm`). ValueError where
    no int4 kernel runs there."""
    if device.type == "cpu":
        return model
    if not tinygemm_runs(device):
        raise ValueError(
            f"int4-wo on {device}: torch's int4 GPU kernel (tinygemm) needs an NVIDIA GPU of "
            "compute capability 8.0 or later; load this variant on the CPU"
        )
    to_tinygemm(model)
    return model.to(device)


def to_tinygemm(model: nn.Module) -> int:
    """Replace each CPU-kernel `PackedLinear4` by a `TinygemmLinear4` over its codes and
    bfloat16 scales and offsets (the two kernels share that convention); returns how many.
    ValueError where a torchao int4 weight could not be adopted (its codes are unreadable)."""
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor

    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(getattr(module, "weight", None), Int4OpaqueTensor):
            raise ValueError(
                f"{name}: a torchao int4 weight whose layout this torch build cannot read back "
                "runs on the CPU only; load this model on the CPU"
            )
        if isinstance(module, PackedLinear4) and module.kernel:
            linear = TinygemmLinear4.from_kernel_operands(
                module.codes(), module.scales_and_zeros, module.bias
            )
            model.set_submodule(name, linear)
            replaced += 1
    return replaced
