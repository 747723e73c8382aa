"""One engine choice per deployment (chapter 9's deployment_choice.py): the book's protocol, and replicas built
together that would each have measured differently serving one choice."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from chapters.ch08_continuous_batching.server import ContinuousSettings
from chapters.ch09_scale_out import deployment_choice
from chapters.ch09_scale_out.deployment_choice import (ChoiceBook, ChoiceLost, PublishAfterStartup, agreed_settings, book_name,
                                                        publish_served, rules_left_open)

GATHER = {"engine": "eager", "precision": "fp32", "attention": "gather"}
KERNEL = {"engine": "eager", "precision": "bf16", "attention": "kernel"}


class ActorHandle:
    """A :class:`ChoiceBook` served as Ray serves an async actor: every call on one event loop of its own."""

    def __init__(self, book: ChoiceBook) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        for name in ("claim", "publish", "wait", "release"):
            setattr(self, name, SimpleNamespace(remote=self._caller(getattr(book, name))))

    def _caller(self, method):
        async def call(*args):
            result = method(*args)
            return await result if asyncio.iscoroutine(result) else result
        return lambda *args: asyncio.run_coroutine_threadsafe(call(*args), self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def ray_get(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda future, timeout=None: future.result(timeout=30))


def start_replica(settings: ContinuousSettings, handle, replica: str, measures_as: dict[str, str], built: list) -> dict[str, str]:
    """What chapter 9's replica does, with a chapter 8 build whose rules, left at auto, would choose ``measures_as``:
    the settings agreed, the app built, and (if it measured) the choice published once started. Returns what it serves."""
    agreed, measures = agreed_settings(settings, handle, replica, wait_step_s=0.05)
    served = dict(measures_as) if rules_left_open(agreed) else {name: getattr(agreed, name) for name in deployment_choice.RULED_FIELDS}
    built.append("measured" if measures else "named")
    if measures:
        health = {"backend": {"engine": {"engine": served["engine"], "precision": served["precision"]}, "attention": served["attention"]}}
        publish_served(handle, replica, health)
    return served


def test_the_first_claim_measures_the_others_wait_and_the_first_record_wins() -> None:
    book = ChoiceBook()
    assert book.claim("a", 60) == {"measure": True}
    assert book.claim("b", 60) == {"wait": True, "claimed_by": "a"}
    assert book.publish("a", GATHER) == GATHER
    assert book.claim("b", 60) == {"choice": GATHER}
    assert book.publish("b", KERNEL) == GATHER  # too late: the record stands


def test_a_claimer_that_never_records_is_replaced_after_its_lease() -> None:
    book = ChoiceBook()
    assert book.claim("a", 0.0) == {"measure": True}
    assert book.claim("b", 60) == {"measure": True}


def test_waiting_ends_when_the_choice_is_recorded_or_after_its_timeout() -> None:
    async def scenario():
        book = ChoiceBook()
        assert await book.wait(0.01) is None
        waiter = asyncio.create_task(book.wait(30))
        book.publish("a", KERNEL)
        return await waiter
    assert asyncio.run(scenario()) == KERNEL


def test_replicas_started_together_serve_the_first_ones_measurement(ray_get) -> None:
    handle, built = ActorHandle(ChoiceBook()), []
    settings = ContinuousSettings(engine="auto", precision="auto", attention="auto")
    try:
        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(lambda i: start_replica(settings, handle, f"r{i}", GATHER if i == 0 else KERNEL, built), range(4)))
    finally:
        handle.close()
    assert all(choice == served[0] for choice in served), served
    assert sorted(built) == ["measured", "named", "named", "named"]  # each built once; only the first measured


def test_a_replica_whose_measurement_lost_the_race_refuses_to_serve_it(ray_get) -> None:
    book = ChoiceBook()
    book.claim("a", 0.0)  # a's lease ran out while it measured; b took over and recorded first
    book.claim("b", 60)
    book.publish("b", GATHER)
    handle = ActorHandle(book)
    health = {"backend": {"engine": {"engine": "eager", "precision": "bf16"}, "attention": "kernel"}}
    try:
        with pytest.raises(ChoiceLost, match="the deployment's choice is"):
            publish_served(handle, "a", health)
    finally:
        handle.close()


def test_a_started_app_publishes_before_its_start_completes_and_a_failed_one_releases_its_claim() -> None:
    events: list[str] = []

    def app_reporting(outcome: str):
        async def app(scope, receive, send) -> None:
            await send({"type": f"lifespan.startup.{outcome}"})
        return app

    async def send(message: dict) -> None:
        events.append(message["type"])

    def lost() -> None:
        raise ChoiceLost("another choice was recorded")

    scope = {"type": "lifespan"}
    for app, publish in ((app_reporting("complete"), lambda: events.append("publish")), (app_reporting("complete"), lost),
                         (app_reporting("failed"), lambda: events.append("publish"))):
        asyncio.run(PublishAfterStartup(app, publish, lambda: events.append("release"))(scope, None, send))
    assert events == ["publish", "lifespan.startup.complete",  # published before the start is reported
                      "release", "lifespan.startup.failed",  # another's choice: the start fails, the claim is released
                      "release", "lifespan.startup.failed"]  # a start that failed by itself releases its claim too


def test_a_released_claim_is_taken_at_once() -> None:
    book = ChoiceBook()
    assert book.claim("a", 600) == {"measure": True}
    book.release("a")
    assert book.claim("b", 600) == {"measure": True}


def test_the_book_is_named_by_the_settings() -> None:
    one, same = ContinuousSettings(max_num_seqs=8), ContinuousSettings(max_num_seqs=8)
    assert book_name(one) == book_name(same) != book_name(ContinuousSettings(max_num_seqs=16))
    assert not rules_left_open(ContinuousSettings(engine="eager", precision="fp32", attention="gather"))
