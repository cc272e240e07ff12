"""A Ray worker node for one test, started in this process as `ray.cluster_utils.Cluster` starts
its nodes (which, unlike `ray start`, joins a loopback-only cluster), and kept until SIGTERM.

usage: python -m tests.workbench.blind_node GCS_ADDRESS
"""

from __future__ import annotations

import signal
import sys

from workbench.ray_executor import loopback_only

loopback_only()


def main(gcs_address: str) -> None:
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(
        gcs_address=gcs_address,
        num_cpus=1,
        num_gpus=0,
        object_store_memory=150 * 2**20,
        min_worker_port=0,
        max_worker_port=0,
        include_log_monitor=False,
        node_manager_port=0,
    )
    params.dashboard_agent_listen_port = None
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    finally:
        node.kill_all_processes(check_alive=False, allow_graceful=True)


if __name__ == "__main__":
    main(sys.argv[1])
