"""LoRA-wrapped linear layers that serve many adapters in one batch.

Model: every adaptable linear layer keeps its original module (float, bitsandbytes int8/4-bit,
torchao: whatever it is) and gains slot-stacked LoRA weights: A [slots, R, in], B [slots, out, R]
and a scaling per slot, padded to the server's max rank R (zero rows / columns add nothing).
Slot 0 is "no adapter". For each step the manager makes a `StepSlots` (which flat token rows use
which slot), which the runner passes in `lora_step_context`; the layer adds `(x @ A[s]^T) @ B[s]^T * scaling[s]` to those rows.
Small steps run it as two batched matmuls over the step's adapters (their rows padded to the
most rows of one adapter; each adapter's A and B read once), larger ones one matmul pair per
adapter. A layer that none of the step's adapters touches adds nothing and costs nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from serve.core.step_scope import step_scope

BATCHED_MAX_TOKENS = 256
"""Steps with at most this many tokens (decode steps) run the two batched matmuls per layer,
when padding at most doubles the rows; larger steps (long prefills) loop over the adapters,
which copies no weights."""


@dataclass(frozen=True)
class BatchedRows:
    """The step's adapter rows as one padded batch [A adapters, W rows], and the way back."""

    slots: torch.Tensor
    """[A]: the slot of each adapter of the step, ascending."""
    first_slot: int | None
    """When the slots are consecutive (the usual case), the first: A and B are then read as a
    slice of the slot stack instead of copied out of it."""
    rows: torch.Tensor
    """[A * W]: flat token row of each (adapter, position); padding repeats row 0."""
    padding: torch.Tensor | None
    """[A, W, 1]: 1.0 at real rows, 0.0 at padding (None: no padding), so padding adds 0."""
    inverse: torch.Tensor
    """[T]: for each token row, its (adapter, position) index into the flattened batch."""
    covered: torch.Tensor | None
    """[T, 1]: 1.0 for rows with an adapter, 0.0 without (None: every row has one)."""


@dataclass(frozen=True)
class StepSlots:
    """One step's adapters: (slot, token rows) for every adapter in the batch, and for small
    steps the same rows padded into one batch. Made per step by the manager, read by every
    layer inside `lora_step_context` (as attention reads its metadata)."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    batched: BatchedRows | None = None
    row_slots: torch.Tensor | None = None
    """[T]: each token row's slot (0: none), the layers gathering every row's A and B: the
    form a captured decode graph replays (`groups` then only say which rows they were)."""


_step_slots: ContextVar[StepSlots | None] = ContextVar("lora_step_slots", default=None)


def lora_step_context(slots: StepSlots | None) -> AbstractContextManager[None]:
    """Make `slots` the adapters of every LoRA layer called inside, on this thread (None: the
    base model only)."""
    return step_scope(_step_slots, slots)


class LoraLinear(nn.Module):
    lora_a: torch.Tensor
    """[slots, max_rank, in]"""
    lora_b: torch.Tensor
    """[slots, out, max_rank], pre-multiplied by the scaling"""
    scaling: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        out_features: int,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "lora_a",
            torch.zeros(num_slots, max_rank, in_features, device=device, dtype=dtype),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(num_slots, out_features, max_rank, device=device, dtype=dtype),
            persistent=False,
        )
        self.register_buffer(
            "scaling", torch.zeros(num_slots, device=device, dtype=dtype), persistent=False
        )
        self.filled: set[int] = set()
        """Slots holding an adapter that changes this layer."""

    def set_slot(
        self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float
    ) -> None:
        """Write one adapter's weights into a slot (None: this adapter leaves the layer alone)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scaling[slot] = 0.0 if a is None else scaling
        self.filled.discard(slot)
        if a is not None and b is not None:
            self.filled.add(slot)  # NOTE: B is stored pre-multiplied by the scaling
            self.lora_a[slot, : a.shape[0]] = a.to(self.lora_a.dtype)
            self.lora_b[slot, :, : b.shape[1]] = (b * scaling).to(self.lora_b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = _step_slots.get()
        if step is not None and step.row_slots is not None:
            return self._per_row(x, y, step.row_slots)
        groups = [(slot, rows) for slot, rows in step.groups if slot in self.filled] if step else []
        if not step or not groups:
            return y
        flat_x = x.reshape(-1, self.in_features).to(self.lora_a.dtype)
        flat_y = y.reshape(-1, self.out_features)
        batch = step.batched
        if batch is not None:
            return self._batched(flat_x, flat_y, batch).view_as(y)
        flat_y = flat_y.clone()
        for slot, rows in groups:
            delta = (flat_x.index_select(0, rows) @ self.lora_a[slot].T) @ self.lora_b[slot].T
            flat_y.index_add_(0, rows, delta.to(flat_y.dtype))
        return flat_y.view_as(y)

    def _per_row(self, x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
        """y plus each row's delta through its own slot's A and B (slot 0 and slots that leave
        this layer alone are zeros): shapes fixed by the row count, whatever the adapters."""
        flat_x = x.reshape(-1, self.in_features).to(self.lora_a.dtype)
        a = self.lora_a.index_select(0, row_slots)  # [T, R, in]
        b = self.lora_b.index_select(0, row_slots)  # [T, out, R]
        delta = torch.bmm(torch.bmm(flat_x[:, None, :], a.transpose(1, 2)), b.transpose(1, 2))
        return (y.reshape(-1, self.out_features) + delta[:, 0].to(y.dtype)).view_as(y)

    def _batched(self, x: torch.Tensor, y: torch.Tensor, batch: BatchedRows) -> torch.Tensor:
        """[T, out]: y plus every adapter's delta on its rows, in two bmm calls; gathers only
        (on the CPU, index_select is several times faster than index_add_ at these sizes)."""
        if batch.first_slot is not None:
            a = self.lora_a[batch.first_slot : batch.first_slot + len(batch.slots)]  # [A, R, in]
            b = self.lora_b[batch.first_slot : batch.first_slot + len(batch.slots)]  # [A, out, R]
        else:
            a = self.lora_a.index_select(0, batch.slots)
            b = self.lora_b.index_select(0, batch.slots)
        xs = x.index_select(0, batch.rows).view(len(batch.slots), -1, x.shape[1])  # [A, W, in]
        if batch.padding is not None:
            xs = xs * batch.padding
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))  # [A, W, out]
        per_row = delta.flatten(0, 1).index_select(0, batch.inverse)  # [T, out]
        if batch.covered is not None:
            per_row = per_row * batch.covered
        return y + per_row.to(y.dtype)


def adaptable_linears(model: nn.Module) -> dict[str, tuple[nn.Module, int, int]]:
    """Linear layers inside the decoder layers (not the head): name -> (module, in, out).
    Works for float, bitsandbytes and torchao linear layers alike."""
    out = {}
    for name, module in model.named_modules():
        in_f, out_f = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if (
            ".layers." in name
            and isinstance(in_f, int)
            and isinstance(out_f, int)
            and not isinstance(module, LoraLinear)
        ) and not any(
            isinstance(c, nn.Module) and hasattr(c, "in_features") for c in module.children()
        ):
            out[name] = (module, in_f, out_f)
    return out


def wrap(
    model: nn.Module,
    num_slots: int,
    max_rank: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, LoraLinear]:
    """Replace every adaptable linear layer by a LoraLinear around it; return them by name."""
    wrapped = {}
    for name, (module, in_f, out_f) in adaptable_linears(model).items():
        layer = LoraLinear(module, in_f, out_f, num_slots, max_rank, device, dtype)
        model.set_submodule(name, layer)
        wrapped[name] = layer
    return wrapped
