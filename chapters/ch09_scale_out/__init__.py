"""Chapter 9: chapter 8's server past one process, on Ray Serve.

Sets what Ray reads when first imported, before the chapter imports it (Ray's processes inherit it): single-machine mode, a
local cluster on 127.0.0.1 only (unless ``SFS_RAY_ADDRESS`` names a cluster to join); the proxy's middleware hook
(:mod:`~chapters.ch09_scale_out.edge`); and the proxy reaching replicas over gRPC, not Ray actor calls."""

import os

if not os.environ.get("SFS_RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
PROXY_MIDDLEWARES = "chapters.ch09_scale_out.edge:proxy_middlewares"
os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_MIDDLEWARES)
os.environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
