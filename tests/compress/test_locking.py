"""build_once: one build per target under its lock, leftovers of that target only removed."""

from __future__ import annotations

from pathlib import Path

from compress.locking import build_once


def test_build_once_leaves_another_targets_build_in_progress_alone(tmp_path: Path) -> None:
    """It removed every stale-looking temporary dir of the cache folder: building `demo-tiny`
    while `demo` trained (under its own lock) would have deleted the latter's work."""
    other = tmp_path / ".demo.tmp-4242-deadbeef"  # `demo` being built by another process
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"half-trained")
    mine = tmp_path / ".demo-tiny.tmp-17-cafe0000"  # an interrupted build of this target
    mine.mkdir()

    def build(out: Path) -> None:
        (out / "done").write_text("ok")

    final = build_once(tmp_path / "demo-tiny", "done", build, "building demo-tiny")
    assert (final / "done").read_text() == "ok"
    assert (other / "model.safetensors").read_bytes() == b"half-trained"
    assert not mine.exists()
    calls: list[Path] = []
    assert build_once(tmp_path / "demo-tiny", "done", calls.append, "again") == final
    assert calls == []  # built once
