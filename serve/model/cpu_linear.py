"""Float32 and bfloat16 linear layers on the CPU through oneDNN with prepacked weights.

Model: `aten::mm` on some x86 CPUs (AMD's, with this torch build) goes to MKL's generic path,
while oneDNN's `brg_matmul` kernels run the same product 1.3-1.7x faster at decode shapes once
the weight is reordered into oneDNN's blocked layout (bfloat16 too: 1.1-1.8x over `F.linear`
at 1-64 rows on an avx512_bf16 CPU). `prepack_linears` replaces every plain float32 or bfloat16
`nn.Linear` of a CPU model by a `PackedLinear` holding only the reordered weight (the
original is released unless another module shares it, as a tied lm_head does).
NOTE: results equal `F.linear`'s up to float32 rounding (about 1e-6 relative); greedy outputs
stay token-exact against `generate` in the engine tests.
"""

from __future__ import annotations

import torch
from torch import nn

from serve.model.opaque_ops import define_opaque_op


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed_weight, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def _packed_linear_fake(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


packed_linear = define_opaque_op(
    "packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor",
    _packed_linear,
    _packed_linear_fake,
)
"""The prepacked product as an opaque op for `torch.compile`: inductor lowers oneDNN's linear
only for weights it froze itself, and with dynamic shapes it does not pick oneDNN at all."""


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """float32, and bfloat16 where oneDNN's bf16 reorder runs on this CPU (it needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU it raises)."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu" and torch.backends.mkldnn.is_available() and dtype in packed_dtypes()
    )


def prepack_linears(model: nn.Module) -> int:
    """Replace every plain float32 or bfloat16 (where this CPU packs it) CPU `nn.Linear` (not
    subclasses: quantized layers keep their own kernels) by a `PackedLinear`; returns how many
    were replaced. A linear that compressed-tensors quantizes (its `quantization_scheme`: W8A8's
    inputs are rounded by its forward hooks) is left as it is."""
    dtypes = packed_dtypes()
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear
        and getattr(m, "quantization_scheme", None) is None
        and type(m.weight.data) is torch.Tensor  # not a quantized tensor subclass (torchao)
        and m.weight.dtype in dtypes
        and m.weight.device.type == "cpu"
    ]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, PackedLinear(module))
    return len(targets)
