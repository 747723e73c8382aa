"""Chapter 9: chapter 8's server past one process, on Ray Serve.

Ray on one machine is kept on loopback. Ray takes the machine's network address as the node's
address (``--node-ip-address 127.0.0.1`` is not honoured: Ray swaps loopback for that address), and
its servers listen there. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is Ray's own single-machine mode
(its default on laptops): the node's address is 127.0.0.1. Ray reads it once, when it is first
imported, and every Ray process inherits it, so it is set here, before anything of this chapter
imports Ray, unless ``SFS_RAY_ADDRESS`` names a cluster to join.

Serve's proxy keeps the project's error contract through :mod:`~chapters.ch09_scale_out.edge`, a
middleware Serve loads in the proxy's process from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``:
set here too, so the proxy of a cluster this process starts inherits it (a cluster started
elsewhere sets it itself: ``deploy/``).

``RAY_SERVE_PROXY_USE_GRPC=1``: the proxy sends requests to replicas, and receives their answers,
over gRPC instead of Ray actor calls (Serve's performance guide, "interdeployment gRPC"). A stream
is one message per token, and on the actor-call path each is a Ray object handed from the replica
to the proxy; measured in the chapter's README.
"""

import os

if not os.environ.get("SFS_RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
PROXY_MIDDLEWARES = "chapters.ch09_scale_out.edge:proxy_middlewares"
os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_MIDDLEWARES)
os.environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
