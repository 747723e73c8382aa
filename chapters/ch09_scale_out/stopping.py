"""Stopping chapter 9 without losing an accepted request: drain at the edge, then the replicas, the proxy, Ray.

The stopping process (``python -m chapters.ch09_scale_out`` on SIGTERM/Ctrl-C, or a ``preStop`` running this module) tells the
detached actor :class:`DrainSignal` to drain: every edge (:class:`DrainAtTheEdge`, in Serve's proxy) refuses new requests with
the contract's 503 and reports itself idle once its last answer is out; then the application is deleted, Serve and Ray stop."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable

import ray

from shared.schemas import REQUEST_ID_HEADER, error_body, request_id_from

log = logging.getLogger("chapters.ch09_scale_out.stopping")
DRAIN_SIGNAL_NAME = "ch09_drain_signal"
DRAIN_SIGNAL_NAMESPACE = "serving_from_scratch"
RETRY_AFTER_S = 1
EXIT_MARGIN_S = 3.0  # the drain command's own calls beyond its waits (the signal's RPCs), before it gives up
DRAINING = "the service is shutting down; retry in a moment (another instance, or this one once it is back)"


class DrainState:
    """Shared by the stopping process and every edge (as the actor :data:`DrainSignal`): whether to drain, which edges idle."""
    def __init__(self) -> None:
        self._draining = asyncio.Event()
        self._all_idle = asyncio.Event()
        self._edges: set[str] = set()
        self._idle: set[str] = set()

    async def register(self, edge_id: str) -> bool:
        """An edge about to pass on its first request. Returns whether draining already (then it passes on none)."""
        if not self._draining.is_set():
            self._edges.add(edge_id)
        return self._draining.is_set()

    async def wait_draining(self) -> None:
        await self._draining.wait()

    async def start(self) -> int:
        """Start the drain; returns how many edges it waits for."""
        self._draining.set()
        self._check_idle()
        return len(self._edges)

    async def report_idle(self, edge_id: str) -> None:
        """An edge draining with nothing in flight."""
        self._idle.add(edge_id)
        self._check_idle()

    async def wait_idle(self, timeout_s: float) -> list[str]:
        """Wait until every registered edge is idle or ``timeout_s`` passed; returns the edges still busy."""
        try:
            await asyncio.wait_for(self._all_idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return sorted(self._edges - self._idle)

    async def wait_drained(self, start_within_s: float, timeout_s: float) -> bool:
        """If a drain starts within ``start_within_s``, wait until it is over (``timeout_s`` at most); whether one started."""
        try:
            await asyncio.wait_for(self._draining.wait(), start_within_s)
        except TimeoutError:
            return False
        await self.wait_idle(timeout_s)
        return True

    def _check_idle(self) -> None:
        if self._draining.is_set() and self._edges <= self._idle:
            self._all_idle.set()


DrainSignal = ray.remote(num_cpus=0)(DrainState)


def drain_signal():
    """The cluster's drain signal: the one that exists, else a new one, detached (a ``preStop`` finds the edges' own)."""
    return DrainSignal.options(name=DRAIN_SIGNAL_NAME, namespace=DRAIN_SIGNAL_NAMESPACE, get_if_exists=True,
                               lifetime="detached").remote()


def drain_edges(timeout_s: float) -> list[str]:
    """Tell every edge to drain and wait until each is idle or ``timeout_s`` passed; returns the edges still busy."""
    signal = drain_signal()
    edges = ray.get(signal.start.remote())
    log.info("draining at %d edge(s): new requests get 503, waiting up to %.1f s for those in flight", edges, timeout_s)
    busy = ray.get(signal.wait_idle.remote(timeout_s))
    if busy:
        log.warning("drain timeout after %.1f s: %d edge(s) still had requests in flight", timeout_s, len(busy))
    else:
        log.info("drained: every request the edges accepted was answered")
    return busy


class DrainAtTheEdge:
    """Middleware around Serve's proxy: counts the requests it passes on; once told to drain, refuses new ones with the
    contract's 503 and reports itself idle when the last one passed on has finished."""
    def __init__(self, app, before_idle: Callable[[], object] | None = None) -> None:
        self.app, self.before_idle = app, before_idle  # before_idle: run (in a thread) before each report of idle
        self.edge_id = uuid.uuid4().hex
        self.in_flight = 0
        self.draining = False
        self._signal = None
        self._registration: asyncio.Future | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._registration is None:
            self._registration = asyncio.ensure_future(self._register())
        await self._registration  # once, before the first request is passed on; done at once afterwards
        if self.draining:
            await _refuse(scope, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.draining and self.in_flight == 0:
                asyncio.ensure_future(self._report_idle())  # not this request's task: its client may be gone

    async def _register(self) -> None:
        if not ray.is_initialized():  # outside a Ray process (a stand-in for Serve's proxy): no cluster to drain with
            return
        try:
            signal = await asyncio.to_thread(drain_signal)
            self.draining = await signal.register.remote(self.edge_id)
        except ray.exceptions.RayError:
            log.exception("the drain signal cannot be reached: this edge passes every request on and cannot drain")
            return
        self._signal = signal
        if not self.draining:
            asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            await self._signal.wait_draining.remote()
        except ray.exceptions.RayError:
            log.warning("the drain signal went away; looking it up again with the next request")
            self._signal, self._registration = None, None
            return
        self.draining = True
        log.info("draining: %d request(s) in flight at this edge; new ones get 503", self.in_flight)
        if self.in_flight == 0:
            await self._report_idle()

    async def _report_idle(self) -> None:
        if self.before_idle is not None:
            await asyncio.to_thread(self.before_idle)
        self._signal.report_idle.remote(self.edge_id)


async def _refuse(scope, send) -> None:
    """The contract's 503 while draining, as chapter 7's, with the request's ``X-Request-ID`` (the client's if sane, else new)."""
    payload = json.dumps(error_body("draining", DRAINING)).encode()
    sent_id = next((bytes(v).decode("latin-1") for k, v in scope.get("headers", []) if bytes(k).lower() == REQUEST_ID_HEADER.lower().encode()), None)
    headers = [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()), (REQUEST_ID_HEADER.lower().encode(), request_id_from(sent_id).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def exit_after(seconds: float) -> None:
    """End this process with status 3 once ``seconds`` have passed, whatever it waits on: a hung ``preStop`` would hold the
    pod for its whole grace period, and a drain run by hand would never return."""
    def give_up() -> None:
        log.error("the drain command ran past %.1f s (joining the cluster or the drain itself); giving up", seconds)
        logging.shutdown()
        os._exit(3)
    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> None:
    """A pod's ``preStop`` (deploy/rayservice.yaml). The head's drains the application: its pod going means the cluster
    goes. A worker's (--follow-s) only waits for a drain the head starts within that many seconds, so a worker removed
    alone does not stop the application, and one removed with the cluster keeps its replicas until their answers are out."""
    parser = argparse.ArgumentParser(prog="python -m chapters.ch09_scale_out.stopping", description=main.__doc__)
    parser.add_argument("--address", default="auto", help="the Ray cluster to join (default: the one on this machine)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="how long to wait for the requests in flight")
    parser.add_argument("--follow-s", type=float, default=0.0,
                        help="0: start the drain; above 0: do not start one, wait this long for one to start, then for it to end")
    parser.add_argument("--connect-timeout-s", type=float, default=15.0,
                        help="how long joining the cluster may take; the whole command ends after this, the waits above and a few seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    exit_after(args.connect_timeout_s + args.follow_s + args.timeout_s + EXIT_MARGIN_S)
    ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    if args.follow_s:
        followed = ray.get(drain_signal().wait_drained.remote(args.follow_s, args.timeout_s))
        log.info("the application drained" if followed else "no drain started: only this pod stops")
        raise SystemExit(0)
    raise SystemExit(1 if drain_edges(args.timeout_s) else 0)


if __name__ == "__main__":
    main()
