"""A Ray cluster on this machine, on loopback only, and Serve's HTTP proxy on the server's address.

``ray.init(address="local")`` starts a head node in this process's session: the GCS, a raylet, the
object store and the workers, all stopped by :func:`local_cluster` on the way out. Ray listens on
the node's address, so it is set to 127.0.0.1 here; without it, Ray picks the machine's network
address. The dashboard (about 1 GB of memory) stays off unless asked for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray import serve

LOOPBACK = "127.0.0.1"
log = logging.getLogger("chapters.ch09_scale_out.cluster")


@contextmanager
def local_cluster(host: str, port: int, cpus: float | None = None, address: str = "",
                  dashboard: bool = False, log_to_driver: bool = True) -> Iterator[None]:
    """Start (or join, with ``address``) a Ray cluster and Serve's proxy on ``host:port``; stop both on exit.

    ``cpus``: the CPUs Ray may hand out (default: this machine's); replicas reserve ``--replica-cpus`` each.
    ``log_to_driver``: relay every Ray process's output to this one's (off: only in the session's log files).
    """
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=log_to_driver)
    else:
        ray.init(address="local", _node_ip_address=LOOPBACK, include_dashboard=dashboard, log_to_driver=log_to_driver,
                 num_cpus=cpus if cpus is not None else os.cpu_count(), logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
        yield
    finally:
        try:
            serve.shutdown()  # every replica drains (graceful_shutdown_timeout_s), then the proxy and controller stop
        finally:
            ray.shutdown()
