"""An instant stand-in for a chapter: it answers ``/v1/inference`` at once with a valid fixed response.

Only for measuring the harness's own ceiling (``python -m benchmarks ceiling``): whatever QPS Locust
reaches against it is the most Locust can send from its core. It is a bare ASGI app on uvicorn,
no framework, so that the server side stays cheaper than the client side. With ``"stream": true``
it streams as chapter 8 does (an ``event: token`` per token, then ``event: done``), all at once:
the ceiling of the streaming client (``python -m benchmarks.harness.streaming run --url ...``).

    python -m benchmarks.harness.trivial_server --port 8001
"""

from __future__ import annotations

import argparse
import json
from functools import lru_cache

import uvicorn

HEALTH = b'{"status":"ok","chapter":"trivial"}'
JSON_HEADERS = [(b"content-type", b"application/json")]


@lru_cache(maxsize=64)
def inference_response(max_new_tokens: int) -> bytes:
    """A contract-shaped answer with ``max_new_tokens`` ids, built once per size."""
    body = {
        "request_id": "trivial",
        "output_ids": [0] * max_new_tokens,
        "text": "\x00" * max_new_tokens,
        "usage": {"prompt_tokens": 0, "completion_tokens": max_new_tokens, "total_tokens": max_new_tokens},
        "timings_ms": {},
    }
    return json.dumps(body).encode()


async def _read_body(receive) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        body.extend(message.get("body", b""))
        if not message.get("more_body"):
            return bytes(body)


async def _send(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


def streamed_response(max_new_tokens: int) -> bytes:
    """The same answer as server-sent events: one ``token`` event per token, then ``done``."""
    token = b'event: token\ndata: {"token_id":0,"text":"\\u0000"}\n\n'
    return token * max_new_tokens + b"event: done\ndata: " + inference_response(max_new_tokens) + b"\n\n"


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/healthz":
        await _send(send, 200, HEALTH)
    elif scope["path"] == "/v1/inference" and scope["method"] == "POST":
        try:
            body = json.loads(await _read_body(receive))
            max_new_tokens = int(body.get("max_new_tokens", 32))
        except (ValueError, AttributeError):
            await _send(send, 400, b'{"error":{"type":"invalid_json","message":"not JSON"}}')
            return
        if body.get("stream"):
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": streamed_response(max_new_tokens)})
            return
        await _send(send, 200, inference_response(max_new_tokens))
    else:
        await _send(send, 404, b'{"error":{"type":"not_found","message":"no such route"}}')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.trivial_server", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
