"""Hot model reload: versions side by side, requests routed to the newest, the old one unloaded by reference count.

A new version takes new requests at once; the versions it replaces are retired: their requests finish, then (or after
``max_unload_wait_s``, cutting off the rest) their backend is closed and every reference to their memory dropped.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from chapters.ch02_fastapi_async.api import Backend
from shared.schemas import ApiError
from shared.weights import LoadedModel

log = logging.getLogger("chapters.ch07_production.models")

MODEL_VERSION_HEADER = "X-Model-Version"


@dataclass(eq=False)
class ModelVersion:
    """One loaded model and the backend (chapter 2's interface: whatever chapter built it) that serves it."""

    name: str
    loaded: LoadedModel | None
    backend: Backend | None
    in_flight: int = 0
    retired: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.source = self.loaded.source if self.loaded is not None else "?"
        self.idle.set()

    @contextmanager
    def use(self) -> Iterator[Backend]:
        """Count one request in for the block; the count is what decides when the version may unload."""
        self.in_flight += 1
        self.idle.clear()
        try:
            yield self.backend
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()


@dataclass(frozen=True)
class Unloaded:
    name: str
    forced: bool
    cut_off: int  # requests still counted when a forced unload happened


class ModelRegistry:
    """The versions being served; the newest non-retired one is the default."""

    def __init__(self, max_unload_wait_s: float) -> None:
        self.max_unload_wait_s = max_unload_wait_s
        self.versions: dict[str, ModelVersion] = {}  # insertion order: oldest first
        self.unloaded: list[Unloaded] = []
        self._retiring: set[asyncio.Task] = set()

    def newest(self) -> ModelVersion | None:
        serving = [v for v in self.versions.values() if not v.retired]
        return serving[-1] if serving else None

    def route(self, name: str | None) -> ModelVersion:
        """The version a new request uses: the one it names, else the newest. 404 for an unknown or retired name."""
        if name:
            version = self.versions.get(name)
            if version is None or version.retired:
                serving = [v.name for v in self.versions.values() if not v.retired]
                raise ApiError(404, "unknown_model_version", f"{MODEL_VERSION_HEADER}: {name!r} is not served; serving: {serving}")
            return version
        version = self.newest()
        if version is None:
            raise ApiError(503, "not_ready", "no model version is loaded yet", {"Retry-After": "1"})
        return version

    async def add(self, version: ModelVersion, retire_previous: bool = True) -> None:
        """Start ``version``'s backend, make it the newest, and retire the others (in the background)."""
        if version.name in self.versions:
            raise ApiError(409, "version_exists", f"model version {version.name!r} is already loaded")
        await version.backend.start()
        previous = [v for v in self.versions.values() if not v.retired]
        self.versions[version.name] = version
        log.info("model version %s (%s) serving", version.name, version.source)
        if retire_previous:
            for old in previous:
                old.retired = True  # from now on no request is routed to it
                task = asyncio.create_task(self.retire(old), name=f"retire-{old.name}")
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def retire(self, version: ModelVersion) -> Unloaded:
        """Wait until nobody uses ``version`` (at most ``max_unload_wait_s``), then close its backend, remove it from
        :attr:`versions` and drop the references to its model and pool."""
        # EXERCISE ch07.3 BEGIN "reference-counted unload, forced after a maximum wait"
        version.retired = True
        forced = False
        try:
            await asyncio.wait_for(version.idle.wait(), self.max_unload_wait_s)
        except TimeoutError:
            forced = True
            log.warning("model version %s: still %d requests in flight after %.1f s; unloading anyway",
                        version.name, version.in_flight, self.max_unload_wait_s)
        outcome = Unloaded(version.name, forced, version.in_flight if forced else 0)
        self.versions.pop(version.name, None)
        backend, version.backend, version.loaded = version.backend, None, None
        await backend.close()
        del backend
        # EXERCISE ch07.3 END
        release_memory()
        self.unloaded.append(outcome)
        log.info("model version %s unloaded%s", outcome.name, f" (forced, {outcome.cut_off} cut off)" if forced else "")
        return outcome

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        for version in list(self.versions.values()):
            if version.backend is not None:
                await version.backend.close()


def release_memory() -> None:
    """Let the allocator see what was just dropped: collect cycles, return cached CUDA blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
