"""The Locust workload: closed loop (``InferenceUser``, the default) or open loop (``OpenLoopUser``).

Closed loop: a user sends its next request the moment the previous answer arrives (no think time),
so the number of requests in flight is always the number of users, and "concurrency 32" means
exactly 32 outstanding requests. Throughput is then what the server sustains at that concurrency,
and latency is what a request waits at it.

Run by the harness as a subprocess (``python -m benchmarks run ...``) and configured through
environment variables, or by hand for exploring:

    locust -f benchmarks/harness/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 20s

Environment (all optional):
    SFS_BENCH_WORKLOAD         default | long | shared-prefix (see benchmarks/harness/workload.py)
    SFS_BENCH_SEED             seeds every user's prompt sequence (user i: seed, i)
    SFS_BENCH_VOCAB_SIZE       output ids must lie in [0, this)
    SFS_BENCH_TIMEOUT_S        a request with no answer by then fails (status 0)
    SFS_BENCH_RECORDS          write every request's timing and outcome to this JSON file
    SFS_BENCH_TARGET_REQUESTS  stop early once this many successful requests finished inside the
                               steady-state window (0: no early stop) ...
    SFS_BENCH_MIN_SECONDS      ... but never before this many seconds after the window opened
    SFS_BENCH_MAX_SECONDS      stop this many seconds after the window opened (0: only Locust's -t)

Open loop (``OpenLoopUser``, named on Locust's command line, with ``-u 1``): requests *arrive* at a
fixed offered rate, as a Poisson process (exponential gaps, seeded), whatever the server answers.
The one user is only a clock: at each arrival it spawns a greenlet that sends the request and
records its answer, so a slow answer never delays the next arrival (many closed-loop users with
pacing would: each waits for its own answer). At most ``SFS_BENCH_MAX_OUTSTANDING`` requests are in
flight; an arrival beyond that is *dropped* (recorded, counted as a failure), which bounds the load
generator's memory and sockets when the server falls behind. After the last arrival the answers
are awaited for ``SFS_BENCH_DRAIN_S``; the ones still missing are recorded as unfinished.

    SFS_BENCH_OPEN_RATE        offered requests per second
    SFS_BENCH_OPEN_SECONDS     how long arrivals go on (the harness adds its lead-in to the window)
    SFS_BENCH_MAX_OUTSTANDING  requests in flight at most (default 256)
    SFS_BENCH_DRAIN_S          how long to await the answers after the last arrival (default 10)

Every response is checked (status 200, exactly max_new_tokens ids, ids inside the vocabulary);
failures are reported to Locust with ``catch_response`` and counted by status code in the records.
Each record also keeps the server's own ``timings_ms`` and the prompt's length.

Distributed mode (Locust's ``--master`` / ``--worker``, started by the harness with ``--workers N``):
every process imports this file; the master runs no users, the workers run them, and each process
writes its own records file (the harness merges them). What one process decides alone above is
agreed through Locust's custom messages, because no worker sees the others' users:

- closed loop: a worker reports when all *its* users have had a first answer (``sfs_steady``); once
  every worker has, the master opens the window at the latest of those times and tells the workers
  (``sfs_window``); they report their successes finished since (``sfs_measured``), and the master
  applies the target / minimum / maximum times to their sum and stops every process at once.
- open loop: each worker runs one ``OpenLoopUser`` at its share of the rate (the harness divides the
  rate and the in-flight cap); the master gives every worker the same start time (``sfs_start``),
  each reports when its arrivals and drain are over (``sfs_done``), and the master then stops them all.
  A worker never quits alone: Locust would hand its users to the other workers.

    SFS_BENCH_WORKERS          the run's number of workers (0 or unset: one process, no master)
    SFS_BENCH_WORKER_INDEX     this worker's index in [0, SFS_BENCH_WORKERS): its prompt and arrival streams
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time

import gevent
from gevent.event import AsyncResult
from locust import FastHttpUser, constant, events, task
from locust.runners import STATE_CLEANUP, STATE_STOPPED, STATE_STOPPING, MasterRunner, WorkerRunner

from benchmarks.harness.workload import DEFAULT_SEED, PromptStream, check_response, get_workload

WORKLOAD = get_workload(os.environ.get("SFS_BENCH_WORKLOAD", "default"))
SEED = int(os.environ.get("SFS_BENCH_SEED", DEFAULT_SEED))
VOCAB_SIZE = int(os.environ.get("SFS_BENCH_VOCAB_SIZE", 258))
TIMEOUT_S = float(os.environ.get("SFS_BENCH_TIMEOUT_S", 120))
RECORDS_PATH = os.environ.get("SFS_BENCH_RECORDS")
TARGET_REQUESTS = int(os.environ.get("SFS_BENCH_TARGET_REQUESTS", 0))
MIN_SECONDS = float(os.environ.get("SFS_BENCH_MIN_SECONDS", 0))
MAX_SECONDS = float(os.environ.get("SFS_BENCH_MAX_SECONDS", 0))
OPEN_RATE = float(os.environ.get("SFS_BENCH_OPEN_RATE", 0))
OPEN_SECONDS = float(os.environ.get("SFS_BENCH_OPEN_SECONDS", 0))
MAX_OUTSTANDING = int(os.environ.get("SFS_BENCH_MAX_OUTSTANDING", 256))
DRAIN_S = float(os.environ.get("SFS_BENCH_DRAIN_S", 10))
WORKERS = int(os.environ.get("SFS_BENCH_WORKERS", 0))
WORKER_INDEX = int(os.environ.get("SFS_BENCH_WORKER_INDEX", 0))
STOP_POLL_S = 0.05  # how often the early stop is checked, and how often a worker reports its count
# The open loop's common start lies this far ahead of the master's message, so that every worker has
# it before the first arrival.
OPEN_START_MARGIN_S = 0.25

SINGLE, MASTER, WORKER = "single", "master", "worker"
_role = SINGLE  # set at init from Locust's runner


class Run:
    """What this Locust process measured: one record per finished request, plus the window's edges.

    The steady-state window opens once every user has had its first answer: the first round of
    requests arrives all at once and waits behind fewer others than any later one, so it is left
    out (of the latency sample, and of the throughput window, which starts with a full queue).
    """

    users_total: int | None = None  # known once Locust has started every user
    users_answered: set[int] = set()  # users whose first request has finished
    steady_at: float | None = None  # wall clock when the window opens
    stopping_at: float | None = None  # wall clock when the stop began: the window closes
    # [start wall time, latency s, status, ok, output tokens, failure reason or None,
    #  the server's timings_ms or None, prompt tokens]
    requests: list[list] = []
    # open loop only: arrival wall times of the requests dropped (too many in flight) or never answered
    dropped_at: list[float] = []
    unfinished_at: list[float] = []
    first_arrival_at: float | None = None
    max_outstanding_seen = 0
    measured_ok = 0  # successes finished inside the window: the sample so far
    stopped_by = "time_limit"  # or "request_target" when the sample was big enough before the time was up
    # distributed mode, on a worker
    window_opens_at: float | None = None  # the run's window, from the master (this worker's steady_at is its own)
    open_start: AsyncResult = AsyncResult()  # the open loop's common start time, from the master
    open_loop_done = False  # its arrivals and drain are over
    # distributed mode, on the master
    steady_by_worker: dict[int, float] = {}
    measured_by_worker: dict[int, int] = {}
    done_workers: set[int] = set()

    @classmethod
    def open_window_if_steady(cls) -> None:
        if cls.steady_at is None and cls.users_total is not None and len(cls.users_answered) >= cls.users_total:
            cls.steady_at = time.time()
            if _role == WORKER:
                _environment.runner.send_message("sfs_steady", {"worker": WORKER_INDEX, "at": cls.steady_at})

    @classmethod
    def counts_toward_sample(cls, finished_at: float) -> bool:
        """Whether a success finishing at ``finished_at`` belongs to the window's sample (the early stop's count)."""
        if _role == WORKER:
            return cls.window_opens_at is not None and finished_at >= cls.window_opens_at
        return cls.steady_at is not None

    @classmethod
    def measured_so_far(cls) -> int:
        """Successes finished inside the window, over every process of the run."""
        return sum(cls.measured_by_worker.values()) if _role == MASTER else cls.measured_ok


_user_numbers = itertools.count()


class InferenceUser(FastHttpUser):
    wait_time = constant(0)  # closed loop: the next request leaves as soon as the answer is in
    network_timeout = TIMEOUT_S
    connection_timeout = TIMEOUT_S

    def on_start(self) -> None:
        local_number = next(_user_numbers)
        # Workers interleave their numbers so that no two users of a run share a prompt stream.
        self.number = local_number if _role == SINGLE else WORKER_INDEX + WORKERS * local_number
        self.prompts = PromptStream(WORKLOAD, SEED, self.number)

    @task
    def infer(self) -> None:
        send_and_record(self.client, self.prompts.next_body())
        if self.number not in Run.users_answered:
            Run.users_answered.add(self.number)
            Run.open_window_if_steady()


def send_and_record(client, body: dict) -> None:
    """Send one request, check its answer, append its record to ``Run.requests``."""
    started_wall, started = time.time(), time.perf_counter()
    with client.post("/v1/inference", json=body, catch_response=True, name="/v1/inference") as response:
        latency_s = time.perf_counter() - started
        status = response.status_code or 0  # 0: no HTTP answer (refused, reset, timed out)
        try:
            payload = response.json() if status == 200 else None
        except ValueError:
            payload = None
        reason = check_response(status, payload, WORKLOAD.max_new_tokens, VOCAB_SIZE)
        if reason is None:
            response.success()
        else:
            response.failure(reason)
    tokens = len(payload["output_ids"]) if reason is None else 0
    timings = payload.get("timings_ms") if reason is None else None
    timings = timings if isinstance(timings, dict) else None
    Run.requests.append([started_wall, latency_s, status, reason is None, tokens, reason, timings, len(body["input_ids"])])
    if reason is None and Run.counts_toward_sample(started_wall + latency_s):  # finished inside the window
        Run.measured_ok += 1


class OpenLoopUser(FastHttpUser):
    """The arrival clock of the open loop (run exactly one per process). See the module's docstring."""

    network_timeout = TIMEOUT_S
    connection_timeout = TIMEOUT_S
    concurrency = MAX_OUTSTANDING  # the HTTP client's connection pool must not cap requests in flight below this

    @task
    def arrive(self) -> None:
        if OPEN_RATE <= 0 or OPEN_SECONDS <= 0:
            raise RuntimeError("OpenLoopUser needs SFS_BENCH_OPEN_RATE and SFS_BENCH_OPEN_SECONDS")
        # The arrival times: the same for every chapter at a given rate (and number of workers). Worker
        # 0's streams are the single process's; independent Poisson streams add up to a Poisson stream.
        gaps = random.Random(SEED + WORKER_INDEX)
        prompts = PromptStream(WORKLOAD, SEED, WORKER_INDEX)
        in_flight: dict[gevent.Greenlet, float] = {}  # greenlet -> its arrival time
        if _role == WORKER:
            began = Run.open_start.get()  # every worker's clock starts at the same instant
            gevent.sleep(max(0.0, began - time.time()))
        else:
            began = time.time()
        Run.first_arrival_at = Run.steady_at = began
        next_at = began
        while next_at < began + OPEN_SECONDS:
            delay = next_at - time.time()
            if delay > 0:
                gevent.sleep(delay)  # an absolute schedule: a late wake-up does not shift later arrivals
            body = prompts.next_body()
            if len(in_flight) >= MAX_OUTSTANDING:
                Run.dropped_at.append(next_at)
            else:
                greenlet = gevent.spawn(send_and_record, self.client, body)
                in_flight[greenlet] = next_at
                greenlet.link(lambda g: in_flight.pop(g, None))
                Run.max_outstanding_seen = max(Run.max_outstanding_seen, len(in_flight))
            next_at += gaps.expovariate(OPEN_RATE)
        Run.stopping_at = time.time()
        gevent.joinall(list(in_flight), timeout=DRAIN_S)
        for greenlet, arrived in list(in_flight.items()):  # still unanswered: record, then stop waiting
            Run.unfinished_at.append(arrived)
            greenlet.kill(block=False)
        Run.stopped_by = "time_limit"
        if _role == WORKER:
            Run.open_loop_done = True
            self.environment.runner.send_message("sfs_done", {"worker": WORKER_INDEX})
            while True:  # the master stops every worker once all are done; never reach a second round
                gevent.sleep(1)
        self.environment.runner.quit()
        gevent.sleep(60)  # quit() stops this greenlet; never reach a second round


def _stop_when_measured(environment) -> None:
    """End the level by the window's own clock: the sample is big enough (after the minimum time), or time is up.

    Timing the window, not the whole run, gives every level the same measuring time however long
    its first round took. Locust's -t still bounds the whole run.
    """
    while True:
        gevent.sleep(STOP_POLL_S)
        if Run.steady_at is None:
            continue
        elapsed = time.time() - Run.steady_at
        enough = TARGET_REQUESTS > 0 and Run.measured_so_far() >= TARGET_REQUESTS and elapsed >= MIN_SECONDS
        out_of_time = MAX_SECONDS > 0 and elapsed >= MAX_SECONDS
        if enough or out_of_time:
            Run.stopped_by = "request_target" if enough else "time_limit"
            environment.runner.quit()
            return


@events.spawning_complete.add_listener
def _on_spawning_complete(user_count: int, **_kwargs) -> None:
    if _role == MASTER:  # it runs no users: it starts the open loop's clocks, or watches the closed loop's sample
        if OPEN_RATE > 0:
            _environment.runner.send_message("sfs_start", {"at": time.time() + OPEN_START_MARGIN_S})
        elif TARGET_REQUESTS > 0 or MAX_SECONDS > 0:
            gevent.spawn(_stop_when_measured, _environment)
        return
    # A worker hears the run's total from the master; its own window waits for its own users only.
    Run.users_total = _environment.runner.target_user_count if _role == WORKER else user_count
    Run.open_window_if_steady()
    if _role == SINGLE and (TARGET_REQUESTS > 0 or MAX_SECONDS > 0):
        gevent.spawn(_stop_when_measured, _environment)


# ---------------------------------------------------------------- distributed mode: the messages


def _on_worker_steady(environment, msg, **_kwargs) -> None:
    """Master: a worker's users have all had a first answer; once every worker's have, the window opens."""
    Run.steady_by_worker[msg.data["worker"]] = msg.data["at"]
    if Run.steady_at is None and len(Run.steady_by_worker) >= WORKERS:
        Run.steady_at = max(Run.steady_by_worker.values())
        environment.runner.send_message("sfs_window", {"opens_at": Run.steady_at})


def _on_worker_measured(environment, msg, **_kwargs) -> None:
    Run.measured_by_worker[msg.data["worker"]] = msg.data["ok"]


def _on_worker_done(environment, msg, **_kwargs) -> None:
    """Master: a worker's open loop is over; once every worker's is, stop them all."""
    Run.done_workers.add(msg.data["worker"])
    if len(Run.done_workers) >= WORKERS:
        # In its own greenlet: quit() kills the runner's greenlets, the one delivering this message among them.
        gevent.spawn(environment.runner.quit)


def _on_window(environment, msg, **_kwargs) -> None:
    """Worker: the run's window opened at ``opens_at`` (maybe before this message arrived): count from there."""
    opens_at = msg.data["opens_at"]
    Run.measured_ok = sum(1 for r in Run.requests if r[3] and r[0] + r[1] >= opens_at)
    Run.window_opens_at = opens_at
    gevent.spawn(_report_measured, environment)


def _report_measured(environment) -> None:
    """Worker: its count, to the master, until the master stops the run (no message into a closing connection)."""
    while environment.runner.state not in (STATE_STOPPING, STATE_CLEANUP, STATE_STOPPED):
        environment.runner.send_message("sfs_measured", {"worker": WORKER_INDEX, "ok": Run.measured_ok})
        gevent.sleep(STOP_POLL_S)


def _on_open_start(environment, msg, **_kwargs) -> None:
    Run.open_start.set(msg.data["at"])


_environment = None  # Locust's Environment, kept at init: the spawning_complete event does not pass it


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    global _environment, _role
    _environment = environment
    if isinstance(environment.runner, MasterRunner):
        _role = MASTER
        environment.runner.register_message("sfs_steady", _on_worker_steady)
        environment.runner.register_message("sfs_measured", _on_worker_measured)
        environment.runner.register_message("sfs_done", _on_worker_done)
    elif isinstance(environment.runner, WorkerRunner):
        _role = WORKER
        environment.runner.register_message("sfs_window", _on_window)
        environment.runner.register_message("sfs_start", _on_open_start)


# test_stopping fires before the users are stopped: the window closes when the stop begins.
@events.test_stopping.add_listener
def _on_stopping(**_kwargs) -> None:
    if Run.stopping_at is None:
        Run.stopping_at = time.time()


@events.quitting.add_listener
def _write_records(**_kwargs) -> None:
    if not RECORDS_PATH:
        return
    with open(RECORDS_PATH, "w") as handle:
        json.dump(
            {
                "workload": WORKLOAD.name,
                "max_new_tokens": WORKLOAD.max_new_tokens,
                "steady_at": Run.steady_at,
                "stopping_at": Run.stopping_at,
                "stopped_by": Run.stopped_by,
                "requests": Run.requests,
                "open_rate": OPEN_RATE or None,
                "first_arrival_at": Run.first_arrival_at,
                "dropped_at": Run.dropped_at,
                "unfinished_at": Run.unfinished_at,
                "max_outstanding_seen": Run.max_outstanding_seen,
                "role": _role,
                "workers": WORKERS,
                "worker_index": WORKER_INDEX if _role == WORKER else None,
                "open_loop_done": Run.open_loop_done,
                "steady_by_worker": Run.steady_by_worker,
                "done_workers": sorted(Run.done_workers),
            },
            handle,
        )
