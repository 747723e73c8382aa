"""A streaming server with no model: ``/v1/inference`` answers 33 server-sent events, one per tick of a
25 ms clock shared by every stream (as a continuous batch's steps are), and records in its ``done``
event when the handler was entered. ``python echo_stream.py PORT [h11|httptools]``; binds 127.0.0.1.
"""

import asyncio
import json
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

TICK_S, TOKENS = 0.025, 33
tick = asyncio.Event()


async def clock() -> None:
    global tick
    while True:
        await asyncio.sleep(TICK_S)
        fired, tick = tick, asyncio.Event()
        fired.set()


@asynccontextmanager
async def lifespan(app: FastAPI):
    task = asyncio.create_task(clock())
    yield
    task.cancel()


app = FastAPI(lifespan=lifespan)


@app.post("/v1/inference")
async def inference(request: Request) -> StreamingResponse:
    entered = time.perf_counter()  # CLOCK_MONOTONIC: comparable with the client's perf_counter on one machine
    await request.body()

    async def events():
        for i in range(TOKENS):
            await tick.wait()
            yield f"event: token\ndata: {json.dumps({'token_id': i})}\n\n".encode()
        yield f"event: done\ndata: {json.dumps({'entered': entered})}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream")


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http=sys.argv[2] if len(sys.argv) > 2 else "auto",
                log_level="warning")
