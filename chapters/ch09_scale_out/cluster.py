"""A Ray cluster on this machine, on loopback only (or one joined by address), and Serve's HTTP proxy on the server's address."""

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
    """Start (or join, with ``address``) a Ray cluster and Serve's proxy on ``host:port``; stop both on exit. ``cpus``: what
    Ray may hand out (default: this machine's); ``log_to_driver``: relay every Ray process's output here, else to its logs."""
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
