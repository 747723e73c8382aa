"""Where chapter 8's memory goes serving the real model (SmolLM2-135M-Instruct), setting by setting.

For each setting, two measurements:

- **stages**, in a fresh process: resident memory (RSS) after importing the server, after loading the
  weights (``load_served_model``), and after building the backend (the engine, the paged pool, the
  attention), with what the served module's tensors and the pool hold;
- **served**: the server itself (``python -m chapters.ch08_continuous_batching``) at ready, and its peak
  (``VmHWM``) after 64 concurrent requests of 100 to 400 prompt tokens and 40 new ones.

From the repository root, one core, as the servers run:

    PYTHONPATH=. taskset -c 0 python benchmarks/studies/real_model_memory/memory_study.py \\
        > benchmarks/studies/real_model_memory/results.txt
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import requests

from benchmarks.harness.server_process import running_module

SETTINGS = {
    "defaults": [],
    "bf16 cache": ["--kv-cache-dtype", "bf16"],
    "bf16 cache, 64 x 512 tokens": ["--kv-cache-dtype", "bf16", "--pool-tokens", "32768"],
    "bf16 products and cache, 64 x 512 tokens": ["--precision", "bf16", "--pool-tokens", "32768"],
}
COMMON = ["--weights", "smollm2", "--device", "cpu", "--torch-threads", "1", "--attention", "kernel", "--probe-interval-s", "3600"]
USERS, NEW_TOKENS = 64, 40

STAGES = r'''
import json, sys
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
import torch
from chapters.ch08_continuous_batching.server import ContinuousSettings, build_backend
from shared.settings import parse_settings
from shared.weights import load_served_model
out = {"imports": rss()}
settings = parse_settings(ContinuousSettings, sys.argv[1:], prog="study")
loaded = load_served_model(settings)
out["weights loaded"] = rss()
backend = build_backend(settings, loaded)
out["backend built"] = rss()
seen, held = set(), 0
for tensor in [*loaded.model.parameters(), *loaded.model.buffers(),
               *(getattr(m, "weight_bf16", None) for m in loaded.model.modules())]:
    if tensor is not None and id(tensor) not in seen:
        seen.add(id(tensor)); held += tensor.numel() * tensor.element_size()
out["served weights"] = held / 2**20
pool = backend.step_thread.scheduler.store.pool.stats()
out["pool"] = pool.bytes_total / 2**20
print(json.dumps(out))
'''


def stages(args: list[str]) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", STAGES, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def status(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as handle:
        return int(handle.read().split(f"{field}:")[1].split()[0]) / 1024


def served(args: list[str]) -> dict[str, float]:
    with running_module("chapters.ch08_continuous_batching", args, name="ch08", startup_timeout_s=300) as server:
        at_ready = status(server.pid, "VmRSS")

        def one(i: int) -> int:
            rng = random.Random(i)
            ids = [rng.randrange(1000, 40000) for _ in range(rng.randrange(100, 400))]
            return requests.post(f"{server.url}/v1/inference", json={"input_ids": ids, "max_new_tokens": NEW_TOKENS},
                                 timeout=600).status_code

        with ThreadPoolExecutor(USERS) as clients:
            codes = set(clients.map(one, range(USERS)))
        return {"at ready": at_ready, "peak under load": status(server.pid, "VmHWM"), "statuses": sorted(codes)}


def main() -> None:
    import torch

    from shared.devices import processor_name

    print(f"{processor_name(torch.device('cpu'))}, torch {torch.__version__}; RSS in MiB; "
          f"served: {USERS} concurrent requests, prompts 100-400 tokens, {NEW_TOKENS} new")
    header = ["setting", "imports", "+weights", "+backend", "weights held", "pool", "server ready", "server peak"]
    print(" | ".join(header))
    for name, extra in SETTINGS.items():
        args = [*COMMON, *extra]
        staged, run = stages(args), served(args)
        cells = [staged["imports"], staged["weights loaded"], staged["backend built"], staged["served weights"],
                 staged["pool"], run["at ready"], run["peak under load"]]
        print(" | ".join([name, *(f"{value:,.0f}" for value in cells)]) + f"   (statuses {run['statuses']})", flush=True)


if __name__ == "__main__":
    main()
