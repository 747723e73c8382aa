"""Graded tests of chapter 9's exercises: the router's ledger (ch09.1), the edge's answer when a replica
dies (ch09.2), a request's token budget (ch09.3), a span's parent across a process (ch09.4).

No Ray cluster: the ledger and the policy are plain objects; the edge runs against ASGI apps that do
what Serve 2.60's proxy does (answer from a replica, send its own plain-text refusal, end a request
whose replica died without a byte, or in the middle of a stream), checked against the contract's
error body and the stream dialects. A stub raises in the call that needs it.
"""

from __future__ import annotations

import json

import pytest

# ----------------------------------------------------------------------------- ch09.3: the token budget


@pytest.mark.exercise("ch09.3")
@pytest.mark.parametrize(("body", "budget"), [
    ({"input_ids": [1, 2, 3], "max_new_tokens": 10}, 13),
    ({"prompt": "héllo", "max_new_tokens": 4}, 6 + 4),  # a text prompt counts its UTF-8 bytes
    ({"model": "m", "prompt": [5, 6], "max_tokens": 7}, 9),
    ({"model": "m", "messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": "de"}], "max_tokens": 1}, 6),
    ({"input_ids": [1], "max_new_tokens": "many"}, None),
    ({"max_new_tokens": 3}, None),
    ([1, 2], None),
])
def test_a_requests_token_budget_is_its_prompt_plus_what_it_may_generate(body, budget) -> None:
    from chapters.ch09_scale_out.routing import token_budget

    assert token_budget(json.dumps(body).encode()) == budget
    assert token_budget(b"not json") is None


@pytest.mark.exercise("ch09.3")
def test_the_edge_writes_the_budget_for_the_router_and_drops_a_clients_own() -> None:
    from chapters.ch09_scale_out.edge import with_token_budget

    scope = {"type": "http", "headers": [(b"x-token-budget", b"1"), (b"host", b"h")]}
    routed = with_token_budget(scope, b'{"input_ids": [1, 2], "max_new_tokens": 30}')
    assert routed["headers"] == [(b"host", b"h"), (b"x-token-budget", b"32")]
    assert with_token_budget(scope, None)["headers"] == [(b"host", b"h")]  # a body too large to read: no budget
    assert scope["headers"][0] == (b"x-token-budget", b"1")  # the proxy's own scope is not changed under it


# ----------------------------------------------------------------------------- ch09.1: the router's ledger


@pytest.mark.exercise("ch09.1")
def test_the_ledger_ranks_replicas_by_tokens_owed_until_their_requests_complete() -> None:
    from chapters.ch09_scale_out.routing import TokenLedger

    ledger = TokenLedger()
    ledger.routed("long", "A", 512 + 64)
    ledger.routed("short-1", "B", 16 + 64)
    ledger.routed("short-2", "B", 16 + 64)
    assert ledger.rank(["A", "B", "C"]) == ["C", "B", "A"]  # three requests in flight, but A owes the most tokens
    ledger.completed("long")
    ledger.completed("unknown")  # a request routed before this ledger existed: nothing to take back
    assert ledger.rank(["A", "B"]) == ["A", "B"] and ledger.owed == {"A": 0, "B": 160}
    ledger.forget("B")
    assert ledger.owed == {"A": 0} and ledger.requests == {}


@pytest.mark.exercise("ch09.1")
def test_least_tokens_offers_the_replica_owing_the_fewest_tokens_first() -> None:
    import asyncio

    from chapters.ch09_scale_out.routing import LeastOutstandingTokensRouter, TokenLedger

    class Replica:
        def __init__(self, replica_id: str) -> None:
            self.replica_id = replica_id

    router = LeastOutstandingTokensRouter.__new__(LeastOutstandingTokensRouter)  # the policy, without Serve's plumbing
    router.ledger = TokenLedger()
    replicas = [Replica("A"), Replica("B"), Replica("C")]
    router.ledger.routed("r1", "A", 300)
    router.ledger.routed("r2", "C", 20)
    ranks = asyncio.run(router.choose_replicas(replicas))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["B"], ["C"], ["A"]]


# ----------------------------------------------------------------------------- ch09.2: the edge
# The proxy is stood in for by ASGI apps that do what Serve 2.60's proxy does: answer from a replica,
# send its own plain-text refusal, or end a request whose replica died without sending anything
# (uvicorn would then answer a plain-text 500) or in the middle of a stream.


def _call_edge(proxy, path: str = "/v1/inference", body: bytes = b'{"input_ids": [1], "max_new_tokens": 2}',
               disconnect_first: bool = False) -> list[dict]:
    import asyncio

    from chapters.ch09_scale_out.edge import ContractAtTheEdge

    sent: list[dict] = []
    incoming = [{"type": "http.disconnect"}] if disconnect_first else [{"type": "http.request", "body": body, "more_body": False}]
    client_gone = asyncio.Event()

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await client_gone.wait()  # the client stays until the test ends
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(asyncio.wait_for(ContractAtTheEdge(proxy)(scope, receive, send), 5))
    return sent


def _response(sent: list[dict]) -> tuple[int, dict, bytes, bool]:
    """(status, headers, body, ended properly) of what the client received."""
    assert sent and sent[0]["type"] == "http.response.start", sent
    headers = {bytes(k).lower(): bytes(v) for k, v in sent[0].get("headers", [])}
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], headers, body, not sent[-1].get("more_body", False)


def _replica_died_first_then(answer: list[dict], bodies: list[bytes]):
    """A proxy whose first attempt ends without a byte (the replica died), then answers ``answer``."""
    attempts = []

    async def proxy(scope, receive, send) -> None:
        bodies.append((await receive())["body"])
        attempts.append(scope["path"])
        if len(attempts) == 1:
            return
        for message in answer:
            await send(message)

    return proxy


OK_ANSWER = [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
             {"type": "http.response.body", "body": b'{"output_ids": [3, 4]}', "more_body": False}]


@pytest.mark.exercise("ch09.2")
def test_a_request_whose_replica_died_before_answering_is_sent_again_with_its_body() -> None:
    bodies: list[bytes] = []
    body = b'{"input_ids": [5, 6], "max_new_tokens": 3}'
    status, headers, answer, ended = _response(_call_edge(_replica_died_first_then(OK_ANSWER, bodies), body=body))
    assert (status, answer, ended) == (200, b'{"output_ids": [3, 4]}', True)
    assert headers[b"x-attempts"] == b"2"  # a replay is visible to whoever counts them
    assert bodies == [body, body]  # the second replica read the same request


@pytest.mark.exercise("ch09.2")
def test_a_request_whose_replicas_die_twice_gets_the_contracts_json_500() -> None:
    async def dead(scope, receive, send) -> None:
        await receive()

    status, headers, body, ended = _response(_call_edge(dead))
    assert status == 500 and headers[b"content-type"] == b"application/json" and ended
    assert json.loads(body)["error"]["type"] == "replica_failed"


@pytest.mark.exercise("ch09.2")
def test_a_client_that_has_gone_is_neither_replayed_nor_answered() -> None:
    calls = []

    async def proxy(scope, receive, send) -> None:
        calls.append(await receive())

    assert _call_edge(proxy, disconnect_first=True) == [] and len(calls) == 1


@pytest.mark.exercise("ch09.2")
def test_a_body_too_large_to_keep_is_not_replayed() -> None:
    from chapters.ch09_scale_out.edge import REPLAY_LIMIT_BYTES

    bodies: list[bytes] = []
    status, _, body, _ = _response(_call_edge(_replica_died_first_then(OK_ANSWER, bodies), body=b"x" * (REPLAY_LIMIT_BYTES + 1)))
    assert status == 500 and json.loads(body)["error"]["type"] == "replica_failed" and len(bodies) == 1


@pytest.mark.exercise("ch09.2")
@pytest.mark.parametrize(("path", "dialect"), [("/v1/inference", "event: error\ndata: "), ("/v1/completions", "data: ")])
def test_a_stream_cut_by_a_dying_replica_ends_with_the_contracts_error_event(path: str, dialect: str) -> None:
    first = b"event: token\ndata: {\"token_id\": 7}\n\n"

    async def cut(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": first, "more_body": True})  # then the replica dies

    status, _, body, ended = _response(_call_edge(cut, path=path))
    assert status == 200 and ended and body.startswith(first)
    last = body[len(first):].decode()
    assert last.startswith(dialect) and last.endswith("\n\n")
    assert json.loads(last.removeprefix(dialect))["error"]["type"] == "replica_failed"


@pytest.mark.exercise("ch09.2")
@pytest.mark.parametrize(("status", "error_type"), [(503, "unavailable"), (408, "deadline_exceeded"), (404, "not_found")])
def test_serves_own_plain_text_refusals_become_the_contracts_json(status: int, error_type: str) -> None:
    async def refuses(scope, receive, send) -> None:  # what Serve's proxy sends (convert_object_to_asgi_messages)
        await receive()
        await send({"type": "http.response.start", "status": status,
                    "headers": [[b"content-type", b"text/plain; charset=utf-8"], [b"x-request-id", b"abc"]]})
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure", "more_body": False})

    got, headers, body, ended = _response(_call_edge(refuses))
    assert got == status and ended and headers[b"content-type"] == b"application/json"
    assert json.loads(body) == {"error": {"type": error_type, "message": "Request dropped due to backpressure"}}
    assert headers[b"x-request-id"] == b"abc" and int(headers[b"content-length"]) == len(body)
    assert (b"retry-after" in headers) == (status == 503)


@pytest.mark.exercise("ch09.2")
def test_the_apps_own_answers_pass_the_edge_unchanged() -> None:
    error = [{"type": "http.response.start", "status": 422, "headers": [(b"content-type", b"application/json")]},
             {"type": "http.response.body", "body": b'{"error": {"type": "invalid_request", "message": "m"}}', "more_body": False}]
    for answer in (OK_ANSWER, error):
        async def proxy(scope, receive, send, answer=answer) -> None:
            await receive()
            for message in answer:
                await send(message)

        assert _call_edge(proxy) == answer


# ----------------------------------------------------------------------------- ch09.4: a span's parent across a process


def _edge_tracer():
    from opentelemetry.sdk.trace import TracerProvider

    return TracerProvider().get_tracer("ch09.4")  # the SDK's own, not the global one: nothing exported


@pytest.mark.exercise("ch09.4")
def test_the_request_carries_the_current_span_as_w3c_traceparent_replacing_the_clients() -> None:
    from opentelemetry import trace

    from chapters.ch09_scale_out.edge import with_trace_context

    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    scope = {"type": "http", "path": "/v1/inference",
             "headers": [(b"host", b"h"), (b"Traceparent", client.encode()), (b"tracestate", b"k=v"), (b"x-request-id", b"r1")]}
    span = _edge_tracer().start_span("edge")
    with trace.use_span(span, end_on_exit=True):
        passed_on = with_trace_context(scope)
    context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}".encode()
    assert [(k, v) for k, v in passed_on["headers"] if k.lower() in (b"traceparent", b"tracestate")] == [(b"traceparent", expected)], \
        "one traceparent, the edge span's, in W3C's format; the client's (any case) and its tracestate gone"
    assert [k for k, _ in passed_on["headers"] if k.lower() not in (b"traceparent", b"tracestate")] == [b"host", b"x-request-id"], \
        "every other header kept, in order"
    assert passed_on["path"] == "/v1/inference" and scope["headers"][1] == (b"Traceparent", client.encode()), \
        "the rest of the scope kept; the caller's scope not changed in place"


@pytest.mark.exercise("ch09.4")
def test_the_replicas_span_opened_from_those_headers_is_the_edge_spans_child() -> None:
    from opentelemetry import propagate, trace

    from chapters.ch09_scale_out.edge import with_trace_context

    tracer = _edge_tracer()
    edge = tracer.start_span("edge")
    with trace.use_span(edge, end_on_exit=True):
        headers = with_trace_context({"type": "http", "headers": []})["headers"]
    # what the replica's shell does in its own process: only the headers cross
    parent = propagate.extract({k.decode("latin-1"): v.decode("latin-1") for k, v in headers})
    shell = tracer.start_span("shell", context=parent)
    assert shell.parent is not None and shell.parent.span_id == edge.get_span_context().span_id
    assert shell.get_span_context().trace_id == edge.get_span_context().trace_id


@pytest.mark.exercise("ch09.4")
def test_without_a_current_span_no_trace_context_is_invented() -> None:
    from chapters.ch09_scale_out.edge import with_trace_context

    passed_on = with_trace_context({"type": "http", "headers": [(b"host", b"h")]})
    assert passed_on["headers"] == [(b"host", b"h")]
