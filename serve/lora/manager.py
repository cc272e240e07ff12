"""The adapter manager: a host registry of loaded adapters and the device slots they run in.

Model: a name maps to its current *version* (an adapter id, never reused). Loading a name again
makes a new version; requests already running keep the version they started with (their
`adapter_id`), new ones get the new version. Unloading removes the name; running requests keep
their version until they finish. A version is kept on the host while a request uses it or while
it is current. At most `max_cpu_loras` names are current: loading another one is refused
(`AdapterLimit`) unless the caller asks to evict, which drops the least recently used. Before a
step, each version the step uses gets one of `max_loras` device slots (slot 0 is "no adapter"),
evicting the least recently used slot that the step does not use; the scheduler never puts more
than `max_loras` distinct versions in one step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from serve.core.config import Positive, check_fields
from serve.lora.adapter import Adapter, AdapterError, load_adapter
from serve.lora.layers import BATCHED_MAX_TOKENS, BatchedRows, LoraLinear, StepSlots, wrap


class AdapterLimit(AdapterError):
    """The host already holds `max_cpu_loras` adapters and the caller did not ask to evict."""


@dataclass(frozen=True)
class LoraConfig:
    max_loras: Positive = 4
    """Distinct adapters in one step, i.e. device slots (giving any LoRA flag turns LoRA
    serving on)."""
    max_lora_rank: Positive = 16
    """Largest adapter rank served; every slot is padded to it."""
    max_cpu_loras: Positive = 16
    """Adapters kept loaded on the host; loading one more is refused (409) unless the request
    says "evict": true."""

    def __post_init__(self) -> None:
        check_fields(self)


class AdapterManager:
    def __init__(
        self, model: nn.Module, config: LoraConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.layers: dict[str, LoraLinear] = wrap(
            model, config.max_loras + 1, config.max_lora_rank, device, dtype
        )
        self.shapes = {n: (m.in_features, m.out_features) for n, m in self.layers.items()}
        self.device, self.dtype = device, dtype
        self.current: OrderedDict[str, int] = OrderedDict()
        """name -> current version, least recently used first."""
        self.versions: dict[int, Adapter] = {}
        self.slots: OrderedDict[int, int] = OrderedDict()
        """version -> device slot, least recently used first."""
        self._next_id = 1
        self.load_seconds: list[float] = []

    def read(self, path: Path, root: Path | None = None) -> Adapter:
        """Read and check an adapter (no state changes: safe off the engine thread); with
        `root`, every file read must resolve inside it."""
        started = time.perf_counter()
        adapter = load_adapter(path, self.shapes, self.config.max_lora_rank, root, self.dtype)
        self.load_seconds.append(time.perf_counter() - started)
        return adapter

    def register(
        self,
        name: str,
        adapter: Adapter,
        in_use: set[int] = frozenset(),  # type: ignore[assignment]
        evict: bool = False,
    ) -> int:
        """Make `adapter` the current version of `name` (a new version if the name exists).
        A new name beyond `max_cpu_loras` evicts the least recently used name when `evict`,
        else raises `AdapterLimit`, changing nothing."""
        if name not in self.current and len(self.current) >= self.config.max_cpu_loras:
            if not evict:
                raise AdapterLimit(
                    f"the server already holds its maximum of {self.config.max_cpu_loras} "
                    f"adapters (--max-cpu-loras): {', '.join(self.current)}; unload one first, or "
                    f'load with "evict": true to drop the least recently used '
                    f"({next(iter(self.current))!r})"
                )
            self.current.popitem(last=False)  # NOTE: never more than max_cpu_loras are current
        version, self._next_id = self._next_id, self._next_id + 1
        self.versions[version] = adapter
        self.current[name] = version
        self.current.move_to_end(name)
        self.release(in_use)
        return version

    def load(self, name: str, path: Path, in_use: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """Read and register; raises AdapterError, changing nothing, when it cannot be served."""
        return self.register(name, self.read(path), in_use)

    def unload(self, name: str, in_use: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        if name not in self.current:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        version = self.current.pop(name)
        self.release(in_use)
        return version

    def resolve(self, name: str) -> int | None:
        version = self.current.get(name)
        if version is not None:
            self.current.move_to_end(name)
        return version

    def release(self, in_use: set[int]) -> None:
        """Drop versions no longer current and not in use."""
        keep = set(self.current.values()) | set(in_use)
        for version in [v for v in self.versions if v not in keep]:
            del self.versions[version]
            self.slots.pop(version, None)

    def prepare_step(
        self, token_versions: list[tuple[int, torch.Tensor]], num_tokens: int
    ) -> StepSlots:
        """Give each (version, token rows) of the step a slot (writing weights into slots that
        change); the step's `StepSlots` for `lora_step_context`."""
        used = {v for v, _ in token_versions}
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
