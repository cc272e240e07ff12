"""One driver per work dir: a lease file with a heartbeat, held while a run builds and measures.

Model: the driver (the process that plans the run and hands tasks to an executor) holds
`<work dir>/.lock` (flock: a second driver on a machine that shares the lock waits for the first,
and the lock goes with a killed driver) and writes `<work dir>/run-lease.json` (host, pid, run id,
heartbeat) every `HEARTBEAT_S`. A driver on another machine, where flock may not reach, refuses a
lease whose heartbeat is fresh and takes over one that is stale (a driver that died: its tasks
died with it). With storage at a URL (`workbench.remote_store`) the lease file is written there
too (flock covers the drivers of the mirror's machine). Tasks never take the lease: they are
idempotent (an artifact is committed whole or not at all), so a rerun of the driver resumes by
skipping every committed hash.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from compress.locking import file_lock
from workbench.storage import read_text, remove, write_text

LEASE = "run-lease.json"
HEARTBEAT_S = 5.0
STALE_AFTER_S = 30.0
"""A lease whose heartbeat is older than this belongs to a driver that is gone."""


class LeaseError(RuntimeError):
    """Another driver is running the work dir."""


@dataclass(frozen=True)
class Lease:
    run_id: str
    host: str
    pid: int
    heartbeat: float
    """time.time() of the latest beat."""

    def alive(self, now: float) -> bool:
        if self.host == socket.gethostname():
            return _pid_alive(self.pid)
        return now - self.heartbeat < STALE_AFTER_S


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lease_file(work_dir: Path, url: str | None) -> str:
    """The lease's file: `<work dir>/run-lease.json`, or `<url>/run-lease.json`."""
    return f"{url}/{LEASE}" if url else str(work_dir / LEASE)


def read_lease(work_dir: Path, url: str | None = None) -> Lease | None:
    try:
        return Lease(**json.loads(read_text(_lease_file(work_dir, url))))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


@contextlib.contextmanager
def driver_lease(work_dir: Path, url: str | None = None) -> Iterator[Lease]:
    """Hold the work dir (and the storage `url` it mirrors) for this process's run; LeaseError
    when another live driver has it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    file = _lease_file(work_dir, url)
    with file_lock(work_dir / ".lock"):
        held = read_lease(work_dir, url)
        if held is not None and held.pid != os.getpid() and held.alive(time.time()):
            raise LeaseError(
                f"{url or work_dir}: run {held.run_id} of the driver {held.host}:{held.pid} "
                f"holds this work dir (heartbeat {time.time() - held.heartbeat:.0f} s ago); wait "
                f"for it to finish or stop it (a dead driver's lease lapses after "
                f"{STALE_AFTER_S:.0f} s)"
            )
        lease = Lease(uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), time.time())
        write_text(file, json.dumps(asdict(lease)))
        stop = threading.Event()
        beat = threading.Thread(target=_beat, args=(work_dir, url, lease, stop), daemon=True)
        beat.start()
        try:
            yield lease
        finally:
            stop.set()
            beat.join()
            remove(file)


def _beat(work_dir: Path, url: str | None, lease: Lease, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        current = read_lease(work_dir, url)
        if current is not None and current.run_id != lease.run_id:
            return  # taken over (this driver was thought dead): the other run owns it now
        beat = Lease(lease.run_id, lease.host, lease.pid, time.time())
        with contextlib.suppress(Exception):  # a storage hiccup: the next beat tries again
            write_text(_lease_file(work_dir, url), json.dumps(asdict(beat)))
