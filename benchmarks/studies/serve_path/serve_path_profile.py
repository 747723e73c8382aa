"""Per-thread py-spy profile of one ch09 replica and Serve's proxy under streamed load (a trial, not a result)."""
from pathlib import Path
import asyncio, collections, os, subprocess, sys, time, json
import httpx, psutil
HERE = Path(__file__).resolve().parent
from benchmarks.harness.server_process import running_module

# "thread" (Serve's default), "nothread", "direct" (Serve's direct ingress: no Python proxy), or "runs64" (Serve's
# default with each answer in about two messages, --stream-interval 64: what is left is the per-request path)
mode = sys.argv[1]
env = {"thread": {}, "nothread": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},
       "direct": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}, "runs64": {}}[mode]
processes = ("replica",) if mode == "direct" else ("replica", "proxy")
ARGS = ["--num-replicas", "1", "--spare-replicas", "0", "--replica-cpus", "0.5", "--torch-threads", "1", "--engine", "eager", "--precision", "bf16",
        "--attention", "gather", "--probe-interval-s", "3600", "--drain-timeout-s", "10", *(["--stream-interval", "64"] if mode == "runs64" else [])]

async def load(url, stop, counts):
    async def client(i):
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            while not stop.is_set():
                body = {"input_ids": list(range(10 + i, 40 + i)), "max_new_tokens": 64, "stream": True}
                n = 0
                async with c.stream("POST", "/v1/inference", json=body) as r:
                    async for line in r.aiter_lines():
                        n += line == "event: token"
                counts.append(n)
    tasks = [asyncio.create_task(client(i)) for i in range(8)]
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)

def find(pid, title):
    return [p for p in psutil.Process(pid).children(recursive=True) if any(title in a for a in p.cmdline())]

from benchmarks.studies.replicas_and_routers.scale_out_compare import haproxy_pids, stop_stray_haproxy
haproxy_before = haproxy_pids()
with running_module("chapters.ch09_scale_out", ARGS, name="ch09-prof", env=env, startup_timeout_s=300) as server:
    replica = find(server.pid, "ServeReplica:")[0].pid
    pids = {"replica": replica}
    if "proxy" in processes:
        pids["proxy"] = find(server.pid, "ProxyActor")[0].pid
    async def main():
        stop, counts = asyncio.Event(), []
        t = asyncio.create_task(load(server.url, stop, counts))
        await asyncio.sleep(5)  # warm-up of the load before sampling
        procs = [await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--duration", "12",
                 "--rate", "50", "--threads", "--format", "raw", "--output", str(HERE / f"profile-{mode}-{name}.collapsed"),
                 stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL) for name, pid in pids.items()]
        started = len(counts); t0 = time.perf_counter()
        await asyncio.gather(*(p.wait() for p in procs))
        done = len(counts) - started; dt = time.perf_counter() - t0
        stop.set(); await t
        bad = [n for n in counts if n != 64]
        print(json.dumps({"mode": mode, "streams_during_profile_per_s": round(done / dt, 2), "streams": len(counts), "incomplete": len(bad)}))
    asyncio.run(main())

stop_stray_haproxy(haproxy_before)
for name in processes:
    per_thread = collections.Counter()
    for line in open(str(HERE / f"profile-{mode}-{name}.collapsed")):
        stack, _, n = line.rpartition(" ")
        per_thread[stack.split(";")[0].split(": ", 1)[-1]] += int(n)
    print(name, "active samples at 50/s over 12 s, by thread:", dict(per_thread.most_common(8)))
