"""Device slots: where the adapter versions a step uses sit in the wrapped linears.

Model: before a step, each version the step uses gets one of `max_loras` device slots (slot 0 is
"no adapter"), its weights written once, evicting the least recently used slot that the step does
not use; the scheduler never puts more than `max_loras` distinct versions in one step. A slot
whose version the registry has dropped is free. Which versions exist is the registry's
(`serve.lora.registry`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from serve.lora.adapter import Adapter, load_adapter
from serve.lora.layers import BATCHED_MAX_TOKENS, BatchedRows, LoraLinear, StepSlots, wrap
from serve.lora.registry import LoraConfig


class AdapterSlots:
    def __init__(
        self,
        model: nn.Module,
        config: LoraConfig,
        device: torch.device,
        dtype: torch.dtype,
        versions: Mapping[int, Adapter],
    ) -> None:
        self.config = config
        self.layers: dict[str, LoraLinear] = wrap(
            model, config.max_loras + 1, config.max_lora_rank, device, dtype
        )
        self.shapes = {n: (m.in_features, m.out_features) for n, m in self.layers.items()}
        self.device, self.dtype = device, dtype
        self.versions = versions
        """The registry's versions (read only)."""
        self.slots: OrderedDict[int, int] = OrderedDict()
        """version -> device slot, least recently used first."""
        self.load_seconds: list[float] = []

    def read(self, path: Path, root: Path | None = None) -> Adapter:
        """Read and check an adapter (no state changes: safe off the engine thread); with
        `root`, every file read must resolve inside it."""
        started = time.perf_counter()
        adapter = load_adapter(path, self.shapes, self.config.max_lora_rank, root, self.dtype)
        self.load_seconds.append(time.perf_counter() - started)
        return adapter

    def prepare_step(
        self, token_versions: list[tuple[int, torch.Tensor]], num_tokens: int
    ) -> StepSlots:
        """Give each (version, token rows) of the step a slot (writing weights into slots that
        change); the step's `StepSlots` for `lora_step_context`."""
        used = {v for v, _ in token_versions}
        for gone in [v for v in self.slots if v not in self.versions]:
            del self.slots[gone]
        assert len(used) <= self.config.max_loras, "the scheduler caps distinct adapters per step"
        groups = [(self._slot_for(version, used), rows) for version, rows in token_versions]
        width = max((len(rows) for _, rows in groups), default=0)
        if groups and num_tokens <= BATCHED_MAX_TOKENS and len(groups) * width <= 2 * num_tokens:
            return StepSlots(groups, self._batched_rows(groups, width, num_tokens))
        return StepSlots(groups)

    def _batched_rows(
        self, groups: list[tuple[int, torch.Tensor]], width: int, num_tokens: int
    ) -> BatchedRows:
        groups = sorted(groups, key=lambda g: g[0])
        slots = [slot for slot, _ in groups]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        rows = torch.zeros(len(groups), width, dtype=torch.long)
        padding = torch.zeros(len(groups), width, 1)
        inverse = torch.zeros(num_tokens, dtype=torch.long)
        covered = torch.zeros(num_tokens, 1)
        for i, (_, token_rows) in enumerate(groups):
            n, cpu_rows = len(token_rows), token_rows.cpu()
            rows[i, :n] = cpu_rows
            padding[i, :n] = 1.0
            inverse[cpu_rows] = i * width + torch.arange(n)
            covered[cpu_rows] = 1.0
        dtype, device = self.dtype, self.device
        return BatchedRows(
            slots=torch.tensor(slots, device=device),
            first_slot=slots[0] if consecutive else None,
            rows=rows.flatten().to(device),
            padding=None if bool(padding.all()) else padding.to(device, dtype),
            inverse=inverse.to(device),
            covered=None if bool(covered.all()) else covered.to(device, dtype),
        )

    def forget_slots(self) -> None:
        """Treat every device slot as empty (after a failed step may have left one half-written)."""
        self.slots.clear()

    def _slot_for(self, version: int, used: set[int]) -> int:
        if version in self.slots:
            self.slots.move_to_end(version)
            return self.slots[version]
        taken = set(self.slots.values())
        free = [s for s in range(1, self.config.max_loras + 1) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(v for v in self.slots if v not in used)
            slot = self.slots.pop(victim)
        adapter = self.versions[version]
        for name, layer in self.layers.items():
            w = adapter.modules.get(name)
            layer.set_slot(
                slot,
                None if w is None else w.a,
                None if w is None else w.b,
                0.0 if w is None else w.scaling,
            )
        self.slots[version] = slot
        return slot
