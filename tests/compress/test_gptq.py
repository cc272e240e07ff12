"""GPTQ against its defining properties: with uncorrelated inputs (a diagonal Hessian) nothing
propagates and it equals round-to-nearest on the same grid, code for code; with correlated
inputs it lowers the layer's output error ||X W^T - X Q^T|| below round-to-nearest's, for every
setting; its codes stay on the grid it records."""

from __future__ import annotations

import pytest
import torch

from compress.gptq import GPTQSettings, Hessian, gptq
from compress.grids import find_grid, rtn
from compress.packed import PackedFormat

FORMATS = [PackedFormat(4, 32), PackedFormat(4, 128), PackedFormat(8, None)]
SETTINGS = [
    GPTQSettings(),
    GPTQSettings(static_groups=True),
    GPTQSettings(act_order=True, static_groups=True),
    GPTQSettings(block_size=32, damp=0.1),
]


def correlated(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, Hessian]:
    torch.manual_seed(seed)
    w = torch.randn(64, 256)
    x = torch.randn(1024, 256) @ (torch.randn(256, 256) * 0.3 + torch.eye(256))
    h = Hessian(256)
    for chunk in x.split(300):  # the running average over uneven batches
        h.add(chunk)
    return w, x, h


def test_hessian_is_two_over_n_xtx() -> None:
    _, x, h = correlated()
    torch.testing.assert_close(h.h, 2 * x.t() @ x / len(x), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_diagonal_hessian_equals_round_to_nearest(fmt: PackedFormat) -> None:
    w, _, _ = correlated()
    diagonal = torch.diag(torch.rand(256) + 0.5)
    got = gptq(w, diagonal, fmt, GPTQSettings())
    expected = rtn(w, fmt)
    assert torch.equal(got.q, expected.q)
    torch.testing.assert_close(got.scales, expected.scales)


@pytest.mark.parametrize("cfg", SETTINGS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gptq_lowers_output_error_below_round_to_nearest(
    fmt: PackedFormat, cfg: GPTQSettings
) -> None:
    w, x, h = correlated()
    got = gptq(w, h.h, fmt, cfg)

    def error(deq: torch.Tensor) -> float:
        return float(((x @ (w - deq).t()) ** 2).mean())

    assert error(got.dequantize()) < 0.75 * error(rtn(w, fmt).dequantize())
    assert int(got.q.max()) <= 2**fmt.bits - 1


def test_static_groups_keep_the_grid_of_the_original_weights() -> None:
    w, _, h = correlated()
    fmt = PackedFormat(4, 32)
    got = gptq(w, h.h, fmt, GPTQSettings(act_order=True, static_groups=True))
    for g in range(256 // 32):
        grid = find_grid(w[:, g * 32 : (g + 1) * 32], 4, sym=False)
        torch.testing.assert_close(got.scales[:, g], grid.scale)
        torch.testing.assert_close(got.zeros[:, g], grid.zero)


def test_dead_input_columns_are_zeroed() -> None:
    w, x, _ = correlated()
    x[:, 5] = 0
    h = Hessian(256)
    h.add(x)
    got = gptq(w, h.h, PackedFormat(8, None), GPTQSettings(sym=True))
    assert torch.all(got.dequantize()[:, 5] == 0)
