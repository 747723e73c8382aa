"""One engine choice per deployment: the first replica to start measures, every replica serves what it chose.

Replicas started together on shared cores would each run chapter 5's and chapter 8's start-up rules under the
others' load and may choose differently, and then one greedy request gets two answers. Where the settings leave a
rule a choice (:data:`RULED_FIELDS` at ``auto``), the first measurement is recorded in a :class:`ChoiceBook` (a
named, detached Ray actor keyed by the settings) and every replica, a replacement included, serves it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from chapters.ch08_continuous_batching.server import ContinuousSettings

log = logging.getLogger(__name__)

RULED_FIELDS = ("engine", "precision", "attention")  # kv_cache_dtype and cuda_graphs follow from these at auto
BOOK_NAMESPACE = "serving-from-scratch"


class ChoiceLost(RuntimeError):
    """This replica measured, but another replica's choice was recorded first: it must not serve its own."""


class ChoiceBook:
    """Who measures, and what was chosen (:func:`choice_book` serves it as an actor). :meth:`claim` answers
    ``{"choice": ...}`` once one is recorded, else ``{"measure": True}`` to the first caller (for ``lease_s``: a
    claimer that dies is replaced after it), else ``{"wait": True}``; the first :meth:`publish` wins."""

    def __init__(self) -> None:
        self.choice: dict[str, str] | None = None
        self.claimed_by: str | None = None
        self.claim_expires = 0.0
        self.recorded = asyncio.Event()

    def claim(self, replica: str, lease_s: float) -> dict[str, Any]:
        if self.choice is not None:
            return {"choice": self.choice}
        now = time.monotonic()
        if self.claimed_by in (None, replica) or now >= self.claim_expires:
            self.claimed_by, self.claim_expires = replica, now + lease_s
            return {"measure": True}
        return {"wait": True, "claimed_by": self.claimed_by}

    def release(self, replica: str) -> None:
        """A claimer whose start failed: the next claim measures at once, not after the lease."""
        if self.choice is None and self.claimed_by == replica:
            self.claimed_by, self.claim_expires = None, 0.0

    def publish(self, replica: str, choice: dict[str, str]) -> dict[str, str]:
        if self.choice is None:
            self.choice = dict(choice)
            self.recorded.set()
        return self.choice

    async def wait(self, timeout_s: float) -> dict[str, str] | None:
        """The recorded choice, or None after ``timeout_s`` without one (then claim again)."""
        try:
            await asyncio.wait_for(self.recorded.wait(), timeout_s)
        except TimeoutError:
            return None
        return self.choice


def rules_left_open(settings: ContinuousSettings) -> bool:
    return any(getattr(settings, name) == "auto" for name in RULED_FIELDS)


def book_name(settings: ContinuousSettings) -> str:
    """The book of every replica built from these settings: named by a digest of them (a new model, a new book)."""
    digest = hashlib.sha256(json.dumps(settings.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]
    return f"sfs-engine-choice-{digest}"


def served_choice(health: dict[str, Any]) -> dict[str, str]:
    """What a built chapter 8 server serves, as settings (from its backend's description in ``/healthz``)."""
    backend = health["backend"]
    return {"engine": backend["engine"]["engine"], "precision": backend["engine"]["precision"], "attention": backend["attention"]}


def agreed_settings(settings: ContinuousSettings, book, replica: str, lease_s: float = 300.0,
                    wait_step_s: float = 30.0) -> tuple[ContinuousSettings, bool]:
    """The settings this replica builds chapter 8 from, and whether it measures: the deployment's choice named, once
    ``book`` (a :class:`ChoiceBook` actor handle) has one; else its own (rules at ``auto``) if it is the first to claim,
    and then it must :func:`publish_served` once started; else it waits for the first one's."""
    import ray

    while True:
        answer = ray.get(book.claim.remote(replica, lease_s))
        if "choice" in answer:
            log.info("engine and attention: the deployment's choice %s", answer["choice"])
            return settings.model_copy(update=answer["choice"]), False
        if "measure" in answer:
            return settings, True
        log.info("engine and attention: waiting for %s's measurement", answer["claimed_by"])
        ray.get(book.wait.remote(wait_step_s))


def publish_served(book, replica: str, health: dict[str, Any]) -> None:
    """Record what this replica, the one that measured, serves (from its ``/healthz`` once started); :class:`ChoiceLost`
    if another replica's choice was recorded first."""
    import ray

    mine = served_choice(health)
    recorded = ray.get(book.publish.remote(replica, mine))
    if recorded != mine:
        raise ChoiceLost(f"measured {mine}, but the deployment's choice is {recorded}: restart to serve it")
    log.info("engine and attention: measured here, recorded for the deployment: %s", mine)


class PublishAfterStartup:
    """ASGI wrapper of the measuring replica's app: once the app has started (its engine and attention chosen), the
    choice is published before the start is reported complete; a failed publish or start releases the claim."""

    def __init__(self, app, publish: Callable[[], None], release: Callable[[], None]) -> None:
        self.app, self.publish, self.release = app, publish, release

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def publish_then_send(message: dict) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    await asyncio.to_thread(self.publish)
                except Exception as error:  # noqa: BLE001 - the start fails with the reason, whatever it is
                    await asyncio.to_thread(self.release)
                    message = {"type": "lifespan.startup.failed", "message": f"{type(error).__name__}: {error}"}
            elif message["type"] == "lifespan.startup.failed":
                await asyncio.to_thread(self.release)
            await send(message)

        await self.app(scope, receive, publish_then_send)


def choice_book(settings: ContinuousSettings):
    """The deployment's :class:`ChoiceBook` actor, created by the first replica that asks (detached: it outlives a
    replica, so a replacement reads the same choice; one per distinct settings on a cluster)."""
    import ray

    actor = ray.remote(num_cpus=0)(ChoiceBook)
    return actor.options(name=book_name(settings), namespace=BOOK_NAMESPACE, get_if_exists=True, lifetime="detached").remote()
