"""One replica: chapter 8's whole server (production shell, continuous backend, streaming, OpenAI
routes) built inside a Ray Serve deployment, behind Serve's HTTP proxy.

Serve owns the process, the HTTP front door and the routing between replicas; inside a replica the
request meets the same FastAPI app that ``python -m chapters.ch08_continuous_batching`` serves, so
one replica answers exactly as chapter 8 does. What Serve needs from it, and where each comes from:

- **how many requests it may hold** (``max_ongoing_requests``): what chapter 8's scheduler runs at
  once plus what its admission lets wait (``max_num_seqs + max_queue``), not Serve's default of 5,
  which would cap a continuous batch at 5 rows. Past that, Serve keeps a request at the proxy
  (``max_queued_requests``) and hands it to the first replica with room, instead of one replica
  refusing while another idles;
- **whether it is healthy** (``check_health``): chapter 7's readiness, a real request through the
  model. Serve has no "alive but not ready" state: a replica whose probe fails is replaced;
- **how it stops**: Serve stops routing to a replica, waits up to ``graceful_shutdown_timeout_s``
  (chapter 7's ``--drain-timeout-s``) for its requests, then shuts the app down; the app's drain
  runs first (readiness 503, new requests 503 + ``Retry-After``, wait for those in flight), exactly
  as on SIGTERM in chapter 7.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve

from chapters.ch07_production.drain import DrainController
from chapters.ch07_production.server import ProductionBackend
from chapters.ch08_continuous_batching.server import ContinuousSettings, build_app


def deployment_options(settings: ContinuousSettings, num_replicas: int, replica_cpus: float) -> dict[str, Any]:
    """Serve's options for the replicas, from chapter 8's limits and chapter 7's drain."""
    return {
        "num_replicas": num_replicas,
        "max_ongoing_requests": settings.max_num_seqs + settings.max_queue,
        "max_queued_requests": settings.max_queue,
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
        # a scheduling unit for Ray, not a limit: the model's threads are --torch-threads
        "ray_actor_options": {"num_cpus": replica_cpus},
    }


def replica_health(backend: ProductionBackend) -> None:
    """Raise when chapter 7's readiness says the replica cannot serve (Serve then replaces it).

    Not yet probed (start-up) and draining (Serve is already stopping it) count as healthy.
    """
    ready, reason = backend.readiness()
    if ready or backend.drain.draining or backend.probe.last is None:
        return
    raise RuntimeError(f"not ready: {reason}")


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
    """Make this replica's internal gRPC server listen on the node's address, not on every interface.

    Ray Serve 2.60 starts one per replica (proxy-to-replica and replica-to-replica calls) on
    ``[::]:0`` and has no setting for the address (ray-project/ray#59908 added it; #64623 adds a port
    range, not an address). The node's address is what every other Ray server of the node listens
    on: 127.0.0.1 on a single machine. Called in the replica's constructor, which Serve runs before
    it starts that server; ``tests/test_ch09_scale_out.py`` checks every listening socket, so a Ray
    that moves the call shows there.
    """
    from ray.serve._private import replica as serve_replica

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

    def __serve_build_asgi_app__(self):
        self.server_app = build_app(self.settings)
        return DrainBeforeShutdown(self.server_app, self.server_app.state.drain)

    async def check_health(self) -> None:
        replica_health(self.server_app.state.production)
