"""Float32 and bfloat16 linear layers on the CPU through oneDNN with prepacked weights.

Model: `aten::mm` on some x86 CPUs (AMD's, with this torch build) goes to MKL's generic path,
while oneDNN's `brg_matmul` kernels run the same product 1.3-1.7x faster at decode shapes once
the weight is reordered into oneDNN's blocked layout (bfloat16 too: 1.1-1.8x over `F.linear`
at 1-64 rows on an avx512_bf16 CPU). `prepack_linears` replaces every plain float32 or bfloat16
`nn.Linear` of a CPU model by a `PackedLinear` holding only the reordered weight (the
original is released unless another module shares it, as a tied lm_head does).
Projections that read the same input in a decoder layer (q/k/v, gate/up: `GROUPS`) become one
product each (`GroupedLinear`): at decode batches oneDNN's per-call cost is a large share of a
small product (merged q/k/v took 0.43-0.52x the three calls' time at one row, 0.59-0.75x at 16,
0.82-0.96x at 64; parity at 1,024 rows), and vLLM runs them merged too. The first member called
with an input computes the group's product; the others return their columns of it, and the last
drops it. A member called with another input (another order, a wrapper that copies it) computes
the product itself: slower, never wrong.
NOTE: results equal `F.linear`'s up to float32 rounding (about 1e-6 relative); greedy outputs
stay token-exact against `generate` in the engine tests.
On a CPU where oneDNN cannot pack bfloat16 (no AVX-512: bfloat16 is emulated), `F.linear` in
bfloat16 costs about 3 ms a row for a 49,152 x 576 head, linear in the rows (6x float32's time
at 512 rows); there bfloat16 linears become `WidenedLinear`s: calls of `WIDEN_ROWS` rows or more
multiply in float32 by a slice of widened weight rows at a time and round the output to
bfloat16 (the same numbers up to float32 summation order), smaller calls keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compress.packed import dequantized_linear
from serve.model.opaque_ops import define_opaque_op

WIDEN_ROWS = 32
"""Rows from which a `WidenedLinear` multiplies in float32. Measured on a 2-core AVX2 CPU:
at 576 -> 1,536 float32 wins from 8 rows, at 576 -> 49,152 from 16-32 (bfloat16 1 / 8 / 32 rows:
3.6 / 24 / 101 ms; widened: 10 / 31 / 61 ms)."""


class PackedLinear(nn.Module):
    packed_weight: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _product(x, self.packed_weight, self.bias, self.out_features)


class WidenedLinear(nn.Module):
    """A bfloat16 linear on a CPU without native bfloat16 (see the module's docstring); the
    weight is the original's (a tied head stays shared)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] < WIDEN_ROWS:
            return F.linear(x, self.weight, self.bias)
        weight = self.weight.detach()
        y = dequantized_linear(flat.float(), lambda a, b: weight[a:b].float(), self.out_features)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections of one input, in the order transformers' decoder layers call them."""


def _product(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return packed_linear(x, packed_weight, bias, out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class _GroupProduct:
    """A group's merged product of its current input, from the first member's call until the
    last member has read it."""

    def __init__(self, bias: torch.Tensor | None, out_features: int) -> None:
        self.bias, self.out_features = bias, out_features
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None


class GroupedLinear(nn.Module):
    """One projection of a group sharing its input: columns [lo, hi) of the group's product."""

    packed_weight: torch.Tensor

    def __init__(
        self,
        group: _GroupProduct,
        packed_weight: torch.Tensor,
        lo: int,
        hi: int,
        in_features: int,
        last: bool,
    ) -> None:
        super().__init__()
        self.group, self.lo, self.hi, self.last = group, lo, hi, last
        self.in_features, self.out_features = in_features, hi - lo
        self.register_buffer("packed_weight", packed_weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if group.x is x and group.y is not None:
            y = group.y
        else:
            y = _product(x, self.packed_weight, group.bias, group.out_features)
            group.x, group.y = x, y
        if self.last:
            group.x = group.y = None
        return y[..., self.lo : self.hi]


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


def _packable(m: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    return (
        type(m) is nn.Linear
        and getattr(m, "quantization_scheme", None) is None
        and type(m.weight.data) is torch.Tensor  # not a quantized tensor subclass (torchao)
        and m.weight.dtype in dtypes
        and m.weight.device.type == "cpu"
    )


def _widenable(m: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    return torch.bfloat16 not in dtypes and _packable(m, (torch.bfloat16,))


def _group(parent: nn.Module, names: tuple[str, ...]) -> int:
    """Replace the projections `names` of `parent` by `GroupedLinear`s over one merged product."""
    linears: list[nn.Linear] = [getattr(parent, n) for n in names]
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    group = _GroupProduct(bias, weight.shape[0])
    lo = 0
    for i, (name, m) in enumerate(zip(names, linears, strict=True)):
        last = i == len(names) - 1
        member = GroupedLinear(group, packed, lo, lo + m.out_features, m.in_features, last)
        setattr(parent, name, member)
        lo += m.out_features
    return len(names)


def _groups(
    model: nn.Module, dtypes: tuple[torch.dtype, ...]
) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(parent, names) of every group whose members are packable linears of one input size,
    dtype and bias presence."""
    found = []
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            linears = [m for m in members if isinstance(m, nn.Linear) and _packable(m, dtypes)]
            kinds = {(m.in_features, m.weight.dtype, m.bias is None) for m in linears}
            if len(linears) == len(names) and len(kinds) == 1:
                found.append((parent, names))
    return found


def prepack_linears(model: nn.Module, merge_groups: bool = True) -> int:
    """Replace every plain float32 or bfloat16 (where this CPU packs it) CPU `nn.Linear` (not
    subclasses: quantized layers keep their own kernels) by a `PackedLinear`, or, for the
    projections of a group (`GROUPS`, with `merge_groups`), by `GroupedLinear`s over one merged
    product, and a bfloat16 one this CPU cannot pack by a `WidenedLinear`; returns how many were
    replaced. A linear that compressed-tensors quantizes (its `quantization_scheme`: W8A8's
    inputs are rounded by its forward hooks) is left as it is."""
    dtypes = packed_dtypes() if torch.backends.mkldnn.is_available() else ()
    grouped = sum(_group(p, names) for p, names in _groups(model, dtypes)) if merge_groups else 0
    targets = [
        (name, PackedLinear if _packable(m, dtypes) else WidenedLinear, m)
        for name, m in model.named_modules()
        if _packable(m, dtypes) or _widenable(m, dtypes)
    ]
    for name, kind, module in targets:
        model.set_submodule(name, kind(module))
    return grouped + len(targets)
