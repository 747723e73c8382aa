"""Chapter 8's ``--stream-interval``: a streamed answer's events written in runs, the same events either way.

- The step thread's listener hands a sequence's tokens over at its first token, then whenever
  ``stream_interval`` are held, and with its ending (hypothesis, against a model of that rule that
  keeps every token): nothing is lost, duplicated or handed over after the ending.
- Served in process: ``/v1/inference`` and ``/v1/completions`` stream the oracle's tokens, the same
  events as at 1, in the writes the rule says, and the step thread hands each stream its tokens in
  the same runs (so the event loop wakes a stream once per run).
- A request's stream gives its reader every token handed over, in order, then the ending, however
  hand-overs and reads interleave, and a reader cancelled while it waits (a client gone) breaks
  nothing for the next hand-over.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from asgi_helpers import until
from hypothesis import given, settings
from hypothesis import strategies as st

from chapters.ch08_continuous_batching.server import ContinuousSettings, build_app
from chapters.ch08_continuous_batching.scheduler import Sequence
from chapters.ch08_continuous_batching.request_stream import Finished, RequestStream, StreamListener
from shared.schemas import ApiError

# One step of the model below: each running sequence either gets a token, finishes with one, or is
# cancelled (the shell's abort: whatever it made so far still goes out, then the error).
steps = st.lists(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["token", "token", "token", "last", "cancel"])),
                          max_size=6), max_size=30)


@given(st.integers(1, 5), steps)
@settings(max_examples=300, deadline=None)
def test_the_listener_hands_each_token_over_once_first_at_once_then_in_runs_and_the_rest_with_the_ending(interval, plan) -> None:
    listener = StreamListener(interval)
    seqs = [Sequence([1], 1000) for _ in range(4)]
    made: dict[int, list[int]] = {i: [] for i in range(4)}
    handed: dict[int, list[int]] = {i: [] for i in range(4)}
    ended: set[int] = set()
    counter = 0
    for step in plan:
        touched: set[int] = set()
        for i, what in step:
            if i in ended or i in touched:
                continue  # one token per sequence per step; nothing after an ending
            touched.add(i)
            if what == "cancel":
                listener.end(seqs[i], ApiError(499, "client_disconnected", "gone"))
                ended.add(i)
                continue
            counter += 1
            made[i].append(counter)
            listener.on_token(seqs[i], counter)
            if what == "last":
                listener.on_finished(seqs[i])
                ended.add(i)
        due = {seqs.index(seq): (tokens, finished) for seq, tokens, finished in listener.take()}
        for i in range(4):
            held = len(made[i]) - len(handed[i])
            # The rule, from what was made and handed over so far: first token, a full run, or the ending.
            ends_now = i in ended and i in touched
            expect_due = ends_now or (held > 0 and (not handed[i] or held >= interval))
            assert (i in due) == expect_due, (i, made[i], handed[i], interval)
            if i in due:
                tokens, finished = due[i]
                handed[i] += tokens
                assert handed[i] == made[i], "every token made before this take, in order, none twice"
                assert (finished is not None) == ends_now
    for i in ended:
        assert handed[i] == made[i]
    assert not any(seqs.index(s) in ended for s in [*listener.tokens, *listener._started]), "an ended sequence leaves nothing behind"


# What happens to a stream, in order: a hand-over of n tokens, a read, a read that waits for the next
# hand-over (of n >= 1 tokens), or a read cancelled while it waits.
stream_plans = st.lists(st.one_of(st.tuples(st.just("push"), st.integers(0, 4)), st.just(("read", 0)),
                                  st.tuples(st.just("waiting read"), st.integers(1, 4)), st.just(("cancelled read", 0))),
                        max_size=30)


@given(stream_plans)
@settings(max_examples=200, deadline=None)
def test_a_request_stream_reads_every_token_in_order_then_the_ending_whatever_the_interleaving(plan) -> None:
    async def scenario() -> None:
        stream = RequestStream(Sequence([1, 2, 3], 64))
        handed, read = [], []

        def push(n: int) -> None:
            tokens = list(range(len(handed), len(handed) + n))
            handed.extend(tokens)
            stream.push(tokens, None)

        for action, n in plan:
            if action == "push":
                push(n)
            elif action == "read" and len(read) < len(handed):
                read.append(await stream.next())
            elif action in ("waiting read", "cancelled read") and len(read) == len(handed):
                reader = asyncio.create_task(stream.next())
                await asyncio.sleep(0)  # one turn of the loop: the reader runs until it waits
                assert not reader.done(), "nothing to read: the reader waits"
                if action == "waiting read":
                    push(n)
                    read.append(await asyncio.wait_for(reader, timeout=5))
                else:
                    reader.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await reader
        ending = Finished(handed, {})
        stream.push([], ending)
        while (event := await stream.next()) is not ending:
            read.append(event)
        assert read == handed
        assert stream.result.result() is ending

    asyncio.run(scenario())


def test_an_interval_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        StreamListener(0)
    with pytest.raises(ValueError):
        ContinuousSettings(weights="default", stream_interval=0)


def settings_for(interval: int) -> ContinuousSettings:
    return ContinuousSettings(weights="default", device="cpu", precision="fp32", pool_tokens=2048, max_num_seqs=4,
                              max_num_batched_tokens=64, probe_interval_s=3600, stream_interval=interval)


class BodyWrites:
    """The app, recording each non-empty body write of every response (what uvicorn would send as one write)."""

    def __init__(self, app) -> None:
        self.app, self.writes = app, []

    async def __call__(self, scope, receive, send) -> None:
        async def recording(message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                self.writes.append(message["body"])
            await send(message)

        await self.app(scope, receive, recording)


def served_stream(interval: int, path: str, body: dict, monkeypatch) -> tuple[list[bytes], list[int]]:
    """One streamed request to a fresh chapter 8 app: its body writes, and the sizes of the runs the
    step thread handed its stream."""
    app = build_app(settings_for(interval))
    recorded = BodyWrites(app)
    runs: list[int] = []
    push = RequestStream.push

    def counting_push(stream, tokens, finished) -> None:
        if stream.seq.prompt_ids == body_prompt(body):
            runs.append(len(tokens))
        push(stream, tokens, finished)

    monkeypatch.setattr(RequestStream, "push", counting_push)

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            await app.state.production.probe.passed.wait()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=recorded), base_url="http://test", timeout=60) as client:
                if path == "/v1/completions":
                    body["model"] = (await client.get("/v1/models")).json()["data"][0]["id"]
                recorded.writes.clear()
                answer = await client.post(path, json=body)
                assert answer.status_code == 200, answer.text
                await until(lambda: app.state.registry.newest().backend.in_flight == 0)

    asyncio.run(scenario())
    return recorded.writes, runs


def body_prompt(body: dict) -> list[int]:
    return body.get("input_ids") or list(body["prompt"].encode())


def token_events(writes: list[bytes]) -> list[dict]:
    text = b"".join(writes).decode()
    return [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n") if block.startswith("event: token")]


@pytest.mark.parametrize("interval", [1, 4])
def test_inference_streams_the_oracles_tokens_in_writes_of_the_interval_after_the_first(interval, oracle, monkeypatch) -> None:
    prompt, n = [5, 6, 7], 10
    writes, runs = served_stream(interval, "/v1/inference", {"input_ids": prompt, "max_new_tokens": n, "stream": True}, monkeypatch)
    events = token_events(writes)
    assert [e["token_id"] for e in events] == oracle(prompt, n)
    full, rest = divmod(n - 1, interval)
    # the first token alone, then runs of the interval, then what is left with the done event
    assert [w.count(b"event: token") for w in writes] == [1] + [interval] * full + [rest]
    assert b"event: done" in writes[-1] and b"event: done" not in b"".join(writes[:-1])
    assert runs == [1] + [interval] * full + ([rest] if rest else []), "the step thread hands the stream its tokens in the same runs"

def test_completions_stream_the_oracles_text_in_writes_of_the_interval_after_the_first(oracle, monkeypatch) -> None:
    prompt, n = "Once upon", 7
    body = {"prompt": prompt, "max_tokens": n, "stream": True}
    writes, runs = served_stream(3, "/v1/completions", dict(body), monkeypatch)
    chunks = [block.removeprefix("data: ") for w in writes for block in w.decode().split("\n\n") if block]
    assert chunks[-1] == "[DONE]"
    texts = [json.loads(c)["choices"][0]["text"] for c in chunks[:-1]]
    assert "".join(texts) == bytes(oracle(list(prompt.encode()), n)).decode(errors="replace")
    assert [w.count(b'"finish_reason":null') for w in writes] == [1, 3, 3, 0]
    assert runs == [1, 3, 3]
