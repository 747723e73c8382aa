"""The live page: watch the batcher decide, at ``/ui/``, fed by a stream of its decisions at ``/ui/events``, off the hot path."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse

from shared.schemas import ApiError, ValidRequest
from shared.settings import ServerSettings

log = logging.getLogger("uvicorn.error")  # where uvicorn says it is running: the page address goes beside it

PAGE_DIR = Path(__file__).parent / "ui"
VIEWER_QUEUE = 64  # events a viewer may be behind before it loses the oldest
HEARTBEAT_S = 15.0  # an idle stream sends a comment this often, so a proxy keeps it open
_FILE_NAME = re.compile(r"[a-z0-9_-]+\.(html|js|css|png)")


def server_time() -> float:
    """The clock every event's ``t`` is read from (seconds; only differences mean anything)."""
    return time.monotonic()


class Viewer:
    """One open page: its queue of serialized events, at most ``capacity`` long, oldest dropped first."""

    def __init__(self, capacity: int = VIEWER_QUEUE) -> None:
        self.queue: deque[str] = deque()
        self.capacity = capacity
        self.dropped = 0  # events lost since the last one this viewer was sent
        self.dropped_total = 0
        self.ready = asyncio.Event()
        self.closed = False

    def offer(self, message: str) -> None:
        if len(self.queue) >= self.capacity:
            self.queue.popleft()
            self.dropped += 1
            self.dropped_total += 1
        self.queue.append(message)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def messages(self) -> AsyncIterator[str]:
        """Server-sent-event messages until :meth:`close`; a comment every ``HEARTBEAT_S`` while idle."""
        while not self.closed:
            if not self.queue:
                self.ready.clear()
                try:
                    await asyncio.wait_for(self.ready.wait(), HEARTBEAT_S)
                except TimeoutError:
                    yield ": idle\n\n"
                continue
            if self.dropped:
                yield f"event: dropped\ndata: {json.dumps({'dropped': self.dropped, 'dropped_total': self.dropped_total})}\n\n"
                self.dropped = 0
            yield self.queue.popleft()


class LiveEvents:
    """One publisher's events (a batcher's, a step thread's), fanned out to every viewer. ``hello`` (called on the event loop)
    describes the publisher now: the first event every new viewer gets."""

    def __init__(self, hello: Callable[[], dict] | None = None) -> None:
        self.viewers: set[Viewer] = set()
        self._hello = hello or dict
        self._loop: asyncio.AbstractEventLoop | None = None
        self.published = 0

    @property
    def watched(self) -> bool:
        """Ask before building an event: with nobody watching, publishing is this check alone."""
        return bool(self.viewers)

    def publish(self, kind: str, event: dict) -> None:
        """From the event loop: send ``event`` (plain JSON data) to every viewer as an SSE event ``kind``."""
        if not self.viewers:
            return
        message = f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
        self.published += 1
        for viewer in self.viewers:
            viewer.offer(message)

    def publish_threadsafe(self, kind: str, event: dict) -> None:
        """From any other thread: the same, in one hand-over to the loop (nothing when nobody watches)."""
        if self.viewers and self._loop is not None:
            self._loop.call_soon_threadsafe(self.publish, kind, event)

    async def watch(self, viewer: Viewer) -> AsyncIterator[str]:
        """Subscribe ``viewer`` for as long as the iteration runs: the ``hello`` event, then every event."""
        self._loop = asyncio.get_running_loop()
        viewer.offer(f"event: hello\ndata: {json.dumps({'t': server_time(), **self._hello()})}\n\n")
        self.viewers.add(viewer)
        try:
            async for message in viewer.messages():
                yield message
        finally:
            self.viewers.discard(viewer)


class LiveView:
    """The page's routes on an app: ``/ui/`` (the page), ``/ui/<file>``, ``/ui/events`` (the stream). ``events`` gives the
    publisher to watch; ``pages`` are folders searched in order for the page's files."""

    def __init__(self, events: Callable[[], LiveEvents], pages: tuple[Path, ...] = (PAGE_DIR,)) -> None:
        self.events = events
        self.pages = pages
        self._viewers: set[Viewer] = set()

    def register(self, app: FastAPI) -> None:
        app.state.live_view = self

        @app.get("/ui", include_in_schema=False)
        async def ui_redirect() -> RedirectResponse:
            return RedirectResponse("/ui/")

        @app.get("/ui/", include_in_schema=False)
        async def ui_page() -> FileResponse:
            return self._file("index.html")

        @app.get("/ui/events", include_in_schema=False)
        async def ui_events() -> StreamingResponse:
            return StreamingResponse(self._stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

        @app.get("/ui/{name}", include_in_schema=False)
        async def ui_file(name: str) -> FileResponse:
            return self._file(name)

    def _file(self, name: str) -> FileResponse:
        if _FILE_NAME.fullmatch(name):
            for folder in self.pages:
                if (folder / name).is_file():
                    return FileResponse(folder / name, headers={"Cache-Control": "no-cache"})
        raise ApiError(404, "not_found", f"no such file of the live page: {name}")

    async def _stream(self) -> AsyncIterator[str]:
        viewer = Viewer()
        self._viewers.add(viewer)
        try:
            async for message in self.events().watch(viewer):
                yield message
        finally:
            self._viewers.discard(viewer)

    def close(self) -> None:
        """End every open stream (the server is exiting)."""
        for viewer in list(self._viewers):
            viewer.close()


def request_row(request: ValidRequest) -> tuple[int, int]:
    """What the page draws of a request in a batch: its prompt length and the new tokens it asked for."""
    return len(request.input_ids), request.max_new_tokens


class LiveViewServer(uvicorn.Server):
    """uvicorn, which says where the page is once it listens and ends the page's streams as it exits."""

    def __init__(self, config: uvicorn.Config, live_view: LiveView | None) -> None:
        super().__init__(config)
        self.live_view = live_view

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.live_view is not None:
            for server in self.servers:
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    log.info("live page: http://%s:%d/ui/", host, port)

    async def shutdown(self, sockets=None) -> None:
        if self.live_view is not None:
            self.live_view.close()  # else uvicorn would wait for them: they never end by themselves
        await super().shutdown(sockets)


def serve(app: FastAPI, settings: ServerSettings) -> None:
    """``uvicorn.run`` for a server with a live page (chapters 3 to 6)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)
    LiveViewServer(config, getattr(app.state, "live_view", None)).run()
