"""int4-wo's torchao weights as the engine's int4 linears.

Model: the `int4-wo` method stores a bfloat16 checkpoint that torchao quantizes as it loads
(each linear's weight an `Int4OpaqueTensor`: the codes in the CPU int4 kernel's layout and its
bfloat16 scales and zeros). `adopt_torchao_int4` puts a `compress.packed.PackedLinear4` over the
same tensors in place of each such linear, so the calls that `dequantize_rows` sends to the
dequantized product take it (see `compress.packed`); `transplant_int4` moves those linears into
the same model loaded in another dtype, so a float32 load of int4-wo is float32 everywhere but
in its int4 products.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.packed import PackedLinear4


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
