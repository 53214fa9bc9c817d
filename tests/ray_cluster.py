"""A real two-node Ray cluster on this machine for tests: a head node and a worker node,
each with its own raylet and object store (``ray.cluster_utils.Cluster``, what Ray's own
multi-node tests use), one CPU each, no dashboard, a small object store. The test
process only starts it: drivers connect with ``ray.init(address=cluster.address)``.

The nodes listen on the address Ray picks for this machine (its own interface address,
or 127.0.0.1 without one): traffic between them never leaves the machine. Forcing
127.0.0.1 does not work, since ``ray.init`` rewrites a loopback address it is given to
that same machine address before it connects.

The conftest's ``ray_cluster`` fixture serves one per test module. A test that kills the
worker node (``kill_worker``) adds one back (``add_worker``) so the next test finds two.

The GCS checks each raylet's health every half second and declares a node dead after
three missed checks, so a killed node is known dead within about two seconds (Ray's
defaults take 30 s and more).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

NODE_ARGS: dict[str, Any] = {
    "num_cpus": 1,
    "include_dashboard": False,
    "object_store_memory": 80 * 1024 * 1024,
}
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


@dataclass
class RayTestCluster:
    """The running cluster; ``address`` is what a driver passes to ``ray.init``."""

    cluster: Any  # ray.cluster_utils.Cluster

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def worker(self) -> Any:
        """The worker node (a ``ray._private.node.Node``); its ``node_id`` is Ray's."""
        (node,) = self.cluster.worker_nodes
        return node

    def kill_worker(self) -> str:
        """SIGKILL the worker node's raylet and its other processes, as a lost machine;
        its Ray node id."""
        node = self.worker
        self.cluster.remove_node(node, allow_graceful=False)
        return node.node_id

    def add_worker(self) -> str:
        """A new worker node, once it has joined; its Ray node id."""
        node = self.cluster.add_node(**NODE_ARGS)
        self.cluster.wait_for_nodes()
        return node.node_id


@contextlib.contextmanager
def two_node_cluster() -> Iterator[RayTestCluster]:
    """Start the head and the worker node, wait until both have joined, stop both after."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={**NODE_ARGS, "_system_config": HEALTH_CHECKS}
    )
    try:
        cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
        yield RayTestCluster(cluster)
    finally:
        cluster.shutdown()


@contextlib.contextmanager
def given_or_local(address: str | None) -> Iterator[str]:
    """For the benchmarks: the cluster at ``address``, else two local nodes for the block."""
    if address:
        yield address
        return
    with two_node_cluster() as cluster:
        yield cluster.address


def scale_or_fail(factor: int, job: int) -> int:
    """An engine task (preprocessing.engines) that fails on job 7, as a tokenizer that
    raises on a document would; here, where Ray's workers can import it."""
    if job == 7:
        raise ValueError("cannot handle job 7")
    return job * factor
