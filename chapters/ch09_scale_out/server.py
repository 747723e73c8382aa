"""Chapter 9's server: ``python -m chapters.ch09_scale_out`` runs chapter 8's server as ``--num-replicas`` Serve replicas.

A Ray cluster on this machine (:mod:`~chapters.ch09_scale_out.cluster`), Serve's HTTP proxy on ``--host``/``--port`` and the
replicas; SIGTERM or Ctrl-C drains at the edge first (:mod:`~chapters.ch09_scale_out.stopping`), then everything stops."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

import ray
from ray import serve

from chapters.ch05_inference_engine.server import EngineOptions
from chapters.ch07_production.request_log import configure_json_logging
from chapters.ch07_production.server import ProductionOptions
from chapters.ch08_continuous_batching.server import ContinuousSettings, PagedPoolOptions, SchedulerOptions, StreamingOptions, TracingOptions
from chapters.ch08_continuous_batching.tracing import OTLP_ENDPOINT_ENV
from chapters.ch09_scale_out.cluster import local_cluster
from chapters.ch09_scale_out.stopping import drain_edges, drain_signal
from chapters.ch09_scale_out.replica import ContinuousReplica, ReplicaOptions, deployment_options
from shared.settings import ServerSettings, parse_settings

log = logging.getLogger("chapters.ch09_scale_out")
APP_NAME = "ch09"


class ScaleOutSettings(ReplicaOptions, SchedulerOptions, StreamingOptions, TracingOptions, PagedPoolOptions, EngineOptions, ProductionOptions, ServerSettings):
    """Chapter 8's knobs (each replica gets them all: :class:`ContinuousSettings`) and the replicas'."""


def replica_settings(settings: ScaleOutSettings) -> ContinuousSettings:
    """What every replica is built from: chapter 8's settings, nothing of the cluster's."""
    return ContinuousSettings.model_validate(settings.model_dump(include=set(ContinuousSettings.model_fields)))


def build_application(settings: ScaleOutSettings):
    """The Serve application: replicas of chapter 8's server, with Serve's options from its limits (``deployment_options``)."""
    replica = replica_settings(settings)
    options = deployment_options(replica, settings)
    return ContinuousReplica.options(**options).bind(replica.model_dump())


def app_builder(args: dict[str, object]):
    """Serve's entry point for a config file (``serve run``/``serve deploy``, KubeRay's ``serveConfigV2``): chapter 9's
    settings by name in ``args``, the ``SFS_*`` environment filling the rest; an unknown name is refused in one line."""
    if unknown := sorted(set(args) - set(ScaleOutSettings.model_fields)):
        raise ValueError(f"chapter 9's args: no setting named {', '.join(unknown)} "
                         "(python -m chapters.ch09_scale_out --help lists them, dashes for underscores)")
    return build_application(ScaleOutSettings(**args))


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch09_scale_out"
    settings = parse_settings(ScaleOutSettings, argv, prog=prog)
    if settings.ray_address and os.environ.get("SFS_RAY_ADDRESS") != settings.ray_address:  # Ray's mode is fixed on import
        print(f"{prog}: error: --ray-address: give the cluster's address as SFS_RAY_ADDRESS={settings.ray_address} "
              "in the environment instead: Ray reads its network mode when it is imported, before flags are parsed",
              file=sys.stderr)
        raise SystemExit(2)
    configure_json_logging(settings.log_level)
    if settings.otlp_endpoint:  # the proxy (edge.py's edge span) reads it: Ray's processes inherit this environment
        os.environ[OTLP_ENDPOINT_ENV] = settings.otlp_endpoint
    port = settings.port or _free_port(settings.host)
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # delivered to sigwait below, not to Ray's threads
    with local_cluster(settings.host, port, address=settings.ray_address, dashboard=settings.ray_dashboard):
        edges_signal = drain_signal()  # the edges find this one (stopping.py); this process removes it at the end
        serve.run(build_application(settings), name=APP_NAME, route_prefix="/", blocking=False)
        log.info("serving %d replica(s) (%d of them spare) on http://%s:%d", settings.num_replicas + settings.spare_replicas,
                 settings.spare_replicas, settings.host, port)
        received = signal.sigwait(stop)
        log.info("%s: draining at the edge, then the replicas, Serve's proxy and Ray stop", signal.Signals(received).name)
        drain_edges(settings.drain_timeout_s)
        serve.delete(APP_NAME)  # the replicas (each drains: nothing is left in it); the edge still answers 503
        ray.kill(edges_signal)  # detached: a cluster joined by address keeps running, and must not stay draining


if __name__ == "__main__":
    main()
