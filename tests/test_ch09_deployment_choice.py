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
from chapters.ch09_scale_out.deployment_choice import ChoiceBook, ChoiceLost, agreed_build, book_name, rules_left_open

GATHER = {"engine": "eager", "precision": "fp32", "attention": "gather"}
KERNEL = {"engine": "eager", "precision": "bf16", "attention": "kernel"}


class ActorHandle:
    """A :class:`ChoiceBook` served as Ray serves an async actor: every call on one event loop of its own."""

    def __init__(self, book: ChoiceBook) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        for name in ("claim", "publish", "wait"):
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


def fake_build(measures_as: dict[str, str], built: list):
    """A chapter 8 build whose rules, left at auto, would choose ``measures_as`` on this replica."""
    def build(settings: ContinuousSettings):
        measured = rules_left_open(settings)
        served = dict(measures_as) if measured else {name: getattr(settings, name) for name in deployment_choice.RULED_FIELDS}
        built.append("measured" if measured else "named")
        health = {"backend": {"engine": {"engine": served["engine"], "precision": served["precision"]}, "attention": served["attention"]}}
        return SimpleNamespace(state=SimpleNamespace(production=SimpleNamespace(health=lambda: health)), served=served)
    return build


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
            apps = list(pool.map(lambda i: agreed_build(settings, handle, f"r{i}", fake_build(GATHER if i == 0 else KERNEL, built),
                                                        wait_step_s=0.05),
                                 range(4)))
    finally:
        handle.close()
    served = [app.served for app in apps]
    assert all(choice == served[0] for choice in served), served
    assert sorted(built) == ["measured", "named", "named", "named"]  # each built once; only the first measured


def test_a_replica_whose_measurement_lost_the_race_refuses_to_serve_it(ray_get) -> None:
    book = ChoiceBook()
    book.claim("a", 0.0)  # a's lease ran out while it measured; b took over and recorded
    book.claim("b", 60)
    book.publish("b", GATHER)
    book.choice, book.claimed_by = None, "a"  # a, still measuring, sees no record yet when it claims ...
    handle = ActorHandle(book)
    original_publish = handle.publish.remote
    handle.publish = SimpleNamespace(remote=lambda replica, choice: (setattr(book, "choice", GATHER), original_publish(replica, choice))[1])
    try:
        with pytest.raises(ChoiceLost, match="the deployment's choice is"):
            agreed_build(ContinuousSettings(attention="auto"), handle, "a", fake_build(KERNEL, []))
    finally:
        handle.close()


def test_the_book_is_named_by_the_settings() -> None:
    one, same = ContinuousSettings(max_num_seqs=8), ContinuousSettings(max_num_seqs=8)
    assert book_name(one) == book_name(same) != book_name(ContinuousSettings(max_num_seqs=16))
    assert not rules_left_open(ContinuousSettings(engine="eager", precision="fp32", attention="gather"))
