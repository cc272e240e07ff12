"""The adapter registry: which adapter versions exist, by name, and who uses them (no torch).

Model: a name maps to its current *version* (an adapter id, never reused). Registering a name
again makes a new version; requests already running keep the version they started with
(`acquire` when a request is added, `release` when it leaves the engine), new ones get the new
version. Unloading removes the name; running requests keep their version until they finish. A
version is kept while a request uses it or while it is current, and dropped the moment neither
holds. At most `max_cpu_loras` names are current: registering another one is refused
(`AdapterLimit`) unless the caller asks to evict, which drops the least recently used name.
Which device slot a version runs in is `serve.lora.slots`' business, not the registry's.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from serve.core.config import Positive, check_fields

Adapter = TypeVar("Adapter")
"""What an adapter is (`serve.lora.adapter.Adapter` in the engine): the registry never looks."""


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message names the problem and the fix."""


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


class AdapterRegistry(Generic[Adapter]):
    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.current: OrderedDict[str, int] = OrderedDict()
        """name -> current version, least recently used first."""
        self.versions: dict[int, Adapter] = {}
        """Every version kept: current, or used by a request."""
        self.users: Counter[int] = Counter()
        """version -> requests in the engine running on it."""
        self._next_id = 1

    def register(self, name: str, adapter: Adapter, evict: bool = False) -> int:
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
            _, evicted = self.current.popitem(last=False)  # never more than max_cpu_loras current
            self._drop_unheld(evicted)
        replaced = self.current.get(name)
        version, self._next_id = self._next_id, self._next_id + 1
        self.versions[version] = adapter
        self.current[name] = version
        self.current.move_to_end(name)
        if replaced is not None:
            self._drop_unheld(replaced)
        return version

    def unload(self, name: str) -> int:
        if name not in self.current:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        version = self.current.pop(name)
        self._drop_unheld(version)
        return version

    def resolve(self, name: str) -> int | None:
        """The current version of `name`, marked most recently used; None when not loaded."""
        version = self.current.get(name)
        if version is not None:
            self.current.move_to_end(name)
        return version

    def acquire(self, version: int) -> None:
        """A request starts on `version` (which must be kept)."""
        if version not in self.versions:
            raise AdapterError(f"adapter version {version} is not loaded")
        self.users[version] += 1

    def release(self, version: int) -> None:
        """A request on `version` has left the engine."""
        self.users[version] -= 1
        if self.users[version] <= 0:
            del self.users[version]
            self._drop_unheld(version)

    def _drop_unheld(self, version: int) -> None:
        if version not in self.users and version not in self.current.values():
            self.versions.pop(version, None)
