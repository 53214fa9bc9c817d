"""Connecting to a Ray cluster, for every stage that runs on one: training
(``training.runtime.ray_launch``) and preprocessing (``preprocessing.engines``).

Ray is an optional dependency (``pip install 'megalith[ray]'``), imported when a job
starts, so that ``megalith --help`` and the other commands do not pay for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import ModuleType

from megalith.errors import MegalithError

ADDRESS_ENV = "RAY_ADDRESS"


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise MegalithError(
            "running on a Ray cluster needs Ray here and on every node: pip install 'megalith[ray]'"
        ) from None
    return ray


@contextlib.contextmanager
def connected(address: str | None = None) -> Iterator[str]:
    """Connected to the Ray cluster at ``address`` (else ``$RAY_ADDRESS``) for the block;
    yields the address. A driver the caller already connected is used as it is."""
    ray = import_ray()
    if ray.is_initialized():
        yield "the cluster this process is connected to"
        return
    address = address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise MegalithError(
            "no Ray cluster given: pass its address (HEAD:6379, or ray://HEAD:10001 from "
            f"outside the cluster) or set {ADDRESS_ENV}"
        )
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError) as error:
        raise MegalithError(f"cannot connect to the Ray cluster at {address}: {error}") from None
    finally:
        # ray.init makes SIGTERM exit the process at once; a cancelled Prefect flow run
        # (TerminationSignal) or `megalith launch ray` must stop the job first.
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield address
    finally:
        ray.shutdown()
