"""One replica: chapter 8's whole server built inside a Ray Serve deployment, behind Serve's HTTP proxy.

A replica answers exactly as chapter 8 does. Serve's options (:func:`deployment_options`) come from chapter 8's limits and
chapter 7's drain; its health is chapter 7's readiness (:func:`replica_health`); it stops by chapter 7's drain."""

from __future__ import annotations

import time
from typing import Any, Literal

import ray
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings
from ray import serve

from chapters.ch07_production.drain import DrainController
from chapters.ch07_production.request_log import configure_json_logging
from chapters.ch07_production.server import ProductionBackend
from chapters.ch08_continuous_batching.server import ContinuousSettings, build_app
from chapters.ch09_scale_out.deployment_choice import PublishAfterStartup, agreed_settings, choice_book, publish_served, rules_left_open
from chapters.ch09_scale_out.routing import request_router_config
from shared.settings import ServerSettings

HEALTH_CHECK_PERIOD_S = 1.0  # check_health reads chapter 7's last verdict (free); the period bounds how soon Serve sees a death
SLOW_PROBE_GRACE_S = 30.0  # how long a replica's readiness probe may stay slow before Serve replaces it (replica_health)


class ReplicaOptions(BaseSettings):
    """How many copies of chapter 8's server, what each reserves, how requests reach them, which cluster."""
    model_config = ServerSettings.model_config
    num_replicas: int = Field(1, ge=1, description="copies of chapter 8's server behind Serve's proxy (with --max-replicas: the fewest)")
    spare_replicas: int = Field(1, ge=0, description="warm spares: replicas running beyond --num-replicas (and autoscaling's fewest), so a "
                                "killed replica's share is carried while its replacement starts; 0: none")
    max_replicas: int = Field(0, ge=0, description="0: always --num-replicas; above it, Serve adds and removes replicas between the two by the requests each holds")
    target_ongoing_requests: int = Field(0, ge=0, description="autoscaling's target of requests held per replica; 0: chapter 8's --max-num-seqs (a full batch)")
    upscale_delay_s: float = Field(30.0, gt=0, description="autoscaling: how long load must stay above the target before a replica is added (Serve's default)")
    downscale_delay_s: float = Field(600.0, gt=0, description="autoscaling: how long load must stay below the target before a replica is removed (Serve's default)")
    autoscale_look_back_s: float = Field(30.0, gt=0, description="autoscaling: the window over which requests held are averaged (Serve's look_back_period_s and default)")
    replica_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each replica (fractions share a core)")
    max_replicas_per_node: int = Field(0, ge=0, description="0: no limit; 1 on a cluster: each replica on a node of its own, so losing "
                                       "a node (a pod) costs one replica and the spare is never beside the replicas it covers")
    router: Literal["pow2", "least-tokens"] = Field("pow2", description="pow2: Serve's default (of two random replicas, fewer requests in flight) | least-tokens: fewest tokens owed (routing.py)")
    ray_address: str = Field("", description="join this Ray cluster (e.g. auto; as SFS_RAY_ADDRESS); empty: start one on this machine, loopback only")
    ray_dashboard: bool = Field(False, description="start Ray's dashboard with the local cluster (about 1 GB of memory)")

    @model_validator(mode="after")
    def _max_at_least_num(self) -> ReplicaOptions:
        if self.max_replicas and self.max_replicas < self.num_replicas:
            raise ValueError(f"--max-replicas ({self.max_replicas}) must be 0 or at least --num-replicas ({self.num_replicas})")
        return self


def autoscaling_config(settings: ContinuousSettings, options: ReplicaOptions) -> dict[str, Any] | None:
    """Serve's autoscaling on requests held per replica, or None for a fixed count."""
    if not options.max_replicas:
        return None
    fewest = options.num_replicas + options.spare_replicas
    return {
        "min_replicas": fewest,
        "initial_replicas": fewest,
        "max_replicas": max(options.max_replicas, fewest),
        "target_ongoing_requests": options.target_ongoing_requests or settings.max_num_seqs,  # a full batch: past it, requests wait
        "upscale_delay_s": options.upscale_delay_s,
        "downscale_delay_s": options.downscale_delay_s,
        "look_back_period_s": options.autoscale_look_back_s,
        "metrics_interval_s": min(10.0, options.autoscale_look_back_s / 2),  # two reports per window: the average has samples
    }


def deployment_options(settings: ContinuousSettings, options: ReplicaOptions) -> dict[str, Any]:
    """Serve's options for the replicas, from chapter 8's limits, chapter 7's drain and the replica options."""
    scaling = autoscaling_config(settings, options)
    return {
        **({"autoscaling_config": scaling} if scaling else {"num_replicas": options.num_replicas + options.spare_replicas}),
        "max_ongoing_requests": settings.max_num_seqs + settings.max_queue,  # not Serve's 5, which would cap a batch at 5 rows
        "max_queued_requests": settings.max_queue,
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "request_router_config": request_router_config(options.router),
        "logging_config": {"log_level": settings.log_level.upper(), "enable_access_log": False},  # chapter 7 logs each request
        "ray_actor_options": {"num_cpus": options.replica_cpus},  # a scheduling unit for Ray, not a limit: see --torch-threads
        **({"max_replicas_per_node": options.max_replicas_per_node} if options.max_replicas_per_node else {}),
    }


def replica_health(backend: ProductionBackend, unready_for_s: float = 0.0) -> None:
    """Raise when chapter 7's readiness says the replica cannot serve (Serve then replaces it). Healthy: not yet probed,
    draining, or a probe only slow for less than ``SLOW_PROBE_GRACE_S`` since the last ready verdict (``unready_for_s``):
    on a busy machine slowness is load, and Serve has no "alive but not ready"."""
    ready, reason = backend.readiness()
    if ready or backend.drain.draining or backend.probe.last is None:
        return
    failed = reason.startswith("the probe failed")  # chapter 7's ReadinessProbe: else it timed out or is still running
    if not failed and unready_for_s < SLOW_PROBE_GRACE_S:
        return
    raise RuntimeError(f"not ready: {reason}" + ("" if failed else f" (for {unready_for_s:.0f} s)"))


class DrainBeforeShutdown:
    """An ASGI app that runs chapter 7's drain when the server around it shuts the app down, then the app's own shutdown."""
    def __init__(self, app, drain: DrainController) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def receive_after_draining():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.drain.drain()
            return message
        await self.app(scope, receive_after_draining, send)


def bind_replica_grpc_to_node_address() -> None:
    """Make this replica's internal gRPC server listen on the node's address (127.0.0.1 on one machine, as Ray's other servers),
    not on every interface: Serve starts it on ``[::]:0``, with no setting, after the replica's constructor, which calls this.
    ``tests/test_ch09_scale_out.py`` checks every listening socket, so a Ray that moves the call shows there."""
    from ray.serve._private import replica as serve_replica  # private: add_port_to_grpc_server is not public in ray.serve
    bind = getattr(serve_replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "binds_node_address", False):
        return
    node_address = ray.util.get_node_ip_address()

    def bind_to_node(server, address: str) -> int:
        return bind(server, address.replace("[::]", f"[{node_address}]" if ":" in node_address else node_address, 1))
    bind_to_node.binds_node_address = True
    serve_replica.add_port_to_grpc_server = bind_to_node


@serve.deployment
@serve.ingress()
class ContinuousReplica:
    """Chapter 8's server as one Serve replica; the app is built in the replica's own process."""
    def __init__(self, settings: dict[str, Any]) -> None:
        bind_replica_grpc_to_node_address()
        self.settings = ContinuousSettings.model_validate(settings)
        configure_json_logging(self.settings.log_level)  # chapter 7's log lines, from the replica's process (Ray relays them)

    def __serve_build_asgi_app__(self):
        if not rules_left_open(self.settings):
            self.server_app = app = build_app(self.settings)
        else:  # one choice for every replica: the first one's measurement
            book, replica = choice_book(self.settings), serve.get_replica_context().replica_tag
            settings, measures = agreed_settings(self.settings, book, replica)
            self.server_app = app = build_app(settings)
            if measures:
                app = PublishAfterStartup(app, lambda: publish_served(book, replica, self.server_app.state.production.health()),
                                          lambda: ray.get(book.release.remote(replica)))
        self.ready_at = time.monotonic()  # the last check_health that found it ready (or still starting)
        return DrainBeforeShutdown(app, self.server_app.state.drain)

    async def check_health(self) -> None:
        backend, now = self.server_app.state.production, time.monotonic()
        if backend.readiness()[0] or backend.probe.last is None:
            self.ready_at = now
        replica_health(backend, unready_for_s=now - self.ready_at)
