"""The adapter registry: versions by name, kept while current or used, and no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from serve.lora.registry import AdapterError, AdapterLimit, AdapterRegistry, LoraConfig

ADAPTER = object()  # the registry never looks inside an adapter


def registry(max_cpu_loras: int = 2) -> AdapterRegistry:
    return AdapterRegistry(LoraConfig(max_loras=2, max_cpu_loras=max_cpu_loras))


def test_a_version_used_by_a_request_outlives_its_unload_until_the_request_leaves() -> None:
    r = registry()
    v1 = r.register("shop", ADAPTER)  # type: ignore[arg-type]
    r.acquire(v1)
    assert r.unload("shop") == v1 and r.resolve("shop") is None
    assert list(r.versions) == [v1]
    r.release(v1)
    assert r.versions == {} and not r.users


def test_reloading_a_name_drops_the_old_version_only_when_nothing_uses_it() -> None:
    r = registry()
    v1 = r.register("shop", ADAPTER)  # type: ignore[arg-type]
    v2 = r.register("shop", ADAPTER)  # type: ignore[arg-type]
    assert (v1, v2) == (1, 2) and list(r.versions) == [2]
    r.acquire(v2)
    v3 = r.register("shop", ADAPTER)  # type: ignore[arg-type]
    assert sorted(r.versions) == [2, 3]
    r.acquire(v2)
    r.release(v2)
    assert sorted(r.versions) == [2, 3]  # one request still on version 2
    r.release(v2)
    assert list(r.versions) == [v3]


def test_a_name_past_max_cpu_loras_is_refused_or_evicts_the_least_recently_used() -> None:
    r = registry(max_cpu_loras=2)
    r.register("a", ADAPTER)  # type: ignore[arg-type]
    r.register("b", ADAPTER)  # type: ignore[arg-type]
    r.resolve("a")  # a is now the most recently used
    with pytest.raises(AdapterLimit, match=r"maximum of 2 .*least recently used \('b'\)"):
        r.register("c", ADAPTER)  # type: ignore[arg-type]
    assert list(r.current) == ["b", "a"]
    r.register("c", ADAPTER, evict=True)  # type: ignore[arg-type]
    assert list(r.current) == ["a", "c"] and sorted(r.versions) == [1, 3]


def test_unknown_names_and_versions_are_refused() -> None:
    r = registry()
    with pytest.raises(AdapterError, match="no adapter named 'x' is loaded"):
        r.unload("x")
    with pytest.raises(AdapterError, match="adapter version 7 is not loaded"):
        r.acquire(7)


def test_the_registry_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from serve.lora.registry import AdapterRegistry, LoraConfig\n"
        "r = AdapterRegistry(LoraConfig()); v = r.register('a', object()); r.acquire(v)\n"
        "print(r.unload('a'), list(r.versions))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1", "[1]"]
