"""GPTQ (Frantar et al., 2022): quantize a weight column by column, each column's rounding error
spread over the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

Model: for a linear layer with calibration inputs X, minimise ||X W^T - X Q^T||^2 over codes Q on
the grid. With H = 2 X^T X (damped by `damp` x mean(diag H)), upper Cholesky factor U of H^-1,
column i's error e = (w_i - q_i) / U_ii updates the later columns by -e U_i,i+1:. Columns go in
blocks of `block_size` (lazy batch updates); the grid of a group is fitted when its first column
is reached (or, with `static_groups`, on the original weights before anything moves).
`act_order` quantizes columns in order of decreasing diag(H); with groups it needs static groups,
so that each group keeps contiguous columns (what the int4 kernel reads). This follows the
reference implementation's `fasterquant` step for step; with a diagonal H (uncorrelated inputs)
nothing propagates and GPTQ equals round-to-nearest on the same grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.grids import Grid, find_grid, from_grids, group_bounds
from compress.packed import PackedFormat, Quantized


@dataclass(frozen=True)
class GPTQSettings:
    damp: float = 0.01
    """Added to diag(H), as a fraction of its mean."""
    block_size: int = 128
    """Columns per lazy batch update."""
    act_order: bool = False
    static_groups: bool = False
    sym: bool = False


class Hessian:
    """Running 2/n X^T X of a layer's inputs over calibration batches."""

    def __init__(self, columns: int) -> None:
        self.h = torch.zeros(columns, columns)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        count = x.shape[0]
        self.h *= self.n / (self.n + count)
        self.n += count
        x = x * (2 / self.n) ** 0.5
        self.h += x.t() @ x


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    h = h.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq(weight: torch.Tensor, h: torch.Tensor, fmt: PackedFormat, cfg: GPTQSettings) -> Quantized:
    """Codes, scales and zeros of `weight` [out, in] for inputs with Hessian `h` [in, in]."""
    w = weight.detach().float().clone()
    h = h.clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    bounds = group_bounds(w.shape[1], fmt)
    size = fmt.group_size or w.shape[1]
    static = [find_grid(w[:, a:b], fmt.bits, cfg.sym) for a, b in bounds]
    perm = torch.argsort(h.diagonal(), descending=True) if cfg.act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_hessian_factor(h, cfg.damp)
    codes = torch.zeros_like(w)
    use_static = cfg.static_groups or fmt.group_size is None
    grids: dict[int, Grid] = dict(enumerate(static)) if use_static else {}
    for i1 in range(0, w.shape[1], cfg.block_size):
        i2 = min(i1 + cfg.block_size, w.shape[1])
        block, errors, u1 = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2]), u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = i1 + i
            group = (int(perm[column]) if perm is not None else column) // size
            if not use_static and column % size == 0:  # as the reference: fitted on W
                grids[group] = find_grid(w[:, column : column + size], fmt.bits, cfg.sym)
            grid = grids[group]
            q = grid.codes(block[:, i : i + 1])[:, 0]
            codes[:, column] = q
            err = (block[:, i] - (q - grid.zero) * grid.scale) / u1[i, i]
            block[:, i:] -= err[:, None] @ u1[i, i:][None, :]
            errors[:, i] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return from_grids(codes, [grids[g] for g in range(len(bounds))])


def check_settings(fmt: PackedFormat, cfg: GPTQSettings) -> str | None:
    """Why these settings cannot make a weight the int4 kernel reads (None: they can)."""
    if cfg.act_order and fmt.group_size is not None and not cfg.static_groups:
        return (
            "act_order with groups reorders the columns of a group; set static_groups: true "
            "(groups fitted before reordering keep contiguous columns)"
        )
    return None
