"""The load generator's distributed mode (``--workers N``): a Locust master and N workers on loopback.

The commands and the merge are checked by hand on made-up inputs; then real runs against the instant
server (``benchmarks.harness.trivial_server``): every worker's requests reach the level's figures, and no
Locust process outlives a level, whether it ends normally, a worker dies, or no worker ever connects.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import benchmarks.harness.loadgen as loadgen
from benchmarks.__main__ import build_parser
from benchmarks.harness.ceiling import ceiling_label
from benchmarks.harness.climb import core_plan_for, open_loop_reproduce, reproduce_command
from benchmarks.harness.loadgen import (
    EXPECT_WORKERS_MAX_WAIT_S,
    LevelPlan,
    OpenLevelPlan,
    distribution_for,
    locust_command,
    locust_processes,
    max_in_flight,
    merge_runs,
    open_locust_processes,
    run_level,
    run_open_level,
)
from benchmarks.harness.profiles import build_profiles, get_profile
from benchmarks.harness.results import REPO_ROOT, LoadGenerator, load_result, save_result
from benchmarks.harness.server_process import running_module
from benchmarks.harness.workload import get_workload
from benchmarks.report.tables import ceiling_line, environment_line, render_open_loop, warnings_for

from synthetic_results import SyntheticLevel, synthetic_open_loop, synthetic_result

URL = "http://127.0.0.1:9"


def closed_plan(workers: int, users: int = 8, seconds: float = 5.0) -> LevelPlan:
    return LevelPlan(users=users, min_s=seconds, max_s=seconds, target_requests=0, workload=get_workload("default"),
                     seed=1234, vocab_size=258, request_timeout_s=10.0, workers=workers)


def open_plan(workers: int, rate: float = 10.0, max_outstanding: int = 256) -> OpenLevelPlan:
    return OpenLevelPlan(rate=rate, lead_in_s=0.5, window_s=2.0, drain_s=5.0, max_outstanding=max_outstanding,
                         slo_ms=1000.0, workload=get_workload("default"), seed=1234, vocab_size=258,
                         request_timeout_s=10.0, workers=workers)


def flag_value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


# ---------------------------------------------------------------- the commands


def test_no_workers_is_the_one_process_run_of_before(tmp_path: Path):
    plan = closed_plan(workers=0)
    [single] = locust_processes(URL, plan, tmp_path / "level-8")
    assert single.role == "single" and single.records_path == tmp_path / "level-8.records.json"
    assert single.command == locust_command(URL, plan, tmp_path / "level-8")
    assert not {"--master", "--worker", "--expect-workers"} & set(single.command)
    assert "SFS_BENCH_WORKERS" not in single.env and single.env["SFS_BENCH_RECORDS"] == str(single.records_path)
    assert single.command[-1] == "InferenceUser" and flag_value(single.command, "-u") == "8"


def test_master_and_workers_listen_and_connect_on_loopback_only(tmp_path: Path):
    master, *workers = locust_processes(URL, closed_plan(workers=3), tmp_path / "level-8")
    port = flag_value(master.command, "--master-bind-port")
    assert master.role == "master" and "--master" in master.command
    assert flag_value(master.command, "--master-bind-host") == "127.0.0.1"
    assert flag_value(master.command, "--expect-workers") == "3"
    # the master gives up on workers that never connect instead of waiting forever (Locust's default)
    assert int(flag_value(master.command, "--expect-workers-max-wait")) == EXPECT_WORKERS_MAX_WAIT_S > 0
    assert flag_value(master.command, "-u") == "8" and master.env["SFS_BENCH_WORKERS"] == "3"
    assert [w.worker_index for w in workers] == [0, 1, 2]
    for worker in workers:
        assert "--worker" in worker.command and "--headless" not in worker.command
        assert flag_value(worker.command, "--master-host") == "127.0.0.1"
        assert flag_value(worker.command, "--master-port") == port
        assert worker.env["SFS_BENCH_WORKERS"] == "3" and worker.env["SFS_BENCH_WORKER_INDEX"] == str(worker.worker_index)
        assert worker.command[-1] == "InferenceUser"
    everything = " ".join(arg for p in (master, *workers) for arg in p.command)
    assert "*" not in everything and "0.0.0.0" not in everything
    # each process its own log and records
    assert len({p.records_path for p in (master, *workers)}) == 4 and len({p.log_path for p in (master, *workers)}) == 4
    assert {p.env["SFS_BENCH_RECORDS"] for p in (master, *workers)} == {str(p.records_path) for p in (master, *workers)}


@pytest.mark.parametrize(("rate", "workers", "cap"), [(10.0, 4, 256), (7.0, 3, 10), (2.5, 1, 64)])
def test_the_open_loop_rate_and_cap_are_split_between_the_workers(tmp_path: Path, rate, workers, cap):
    master, *shares = open_locust_processes(URL, open_plan(workers, rate, cap), tmp_path / "rate")
    # one arrival clock per worker; the master runs none
    assert flag_value(master.command, "-u") == str(workers) and master.command[-1] == "OpenLoopUser"
    assert float(master.env["SFS_BENCH_OPEN_RATE"]) == rate  # recorded as offered
    assert len(shares) == workers
    assert sum(float(w.env["SFS_BENCH_OPEN_RATE"]) for w in shares) == pytest.approx(rate)  # the total offered stays
    assert len({w.env["SFS_BENCH_OPEN_RATE"] for w in shares}) == 1
    assert sum(int(w.env["SFS_BENCH_MAX_OUTSTANDING"]) for w in shares) <= cap  # in flight at most the cap, in all
    assert all(w.env["SFS_BENCH_OPEN_SECONDS"] == master.env["SFS_BENCH_OPEN_SECONDS"] == "2.5" for w in shares)


def test_a_negative_number_of_workers_is_refused():
    with pytest.raises(ValueError):
        distribution_for(-1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ceiling", "--workers", "-1"])


def test_every_measuring_command_takes_workers_and_defaults_to_one_process():
    parser = build_parser()
    for command in (["run", "--chapter", "ch02"], ["climb"], ["openloop"], ["ceiling"]):
        assert parser.parse_args(command).loadgen_workers == 0
        assert parser.parse_args([*command, "--workers", "2"]).loadgen_workers == 2
    # the server's own --workers still goes through --server-arg
    args = parser.parse_args(["run", "--chapter", "ch01", "--server-arg=--workers=2", "--workers", "1"])
    assert args.server_arg == ["--workers=2"] and args.loadgen_workers == 1


def test_the_reproduce_commands_name_the_workers():
    profile, workload = get_profile("cpu"), get_workload("default")
    assert "--workers 2" in reproduce_command("ch02", profile, workload, [], "ch02", None, None, 2)
    assert "--workers" not in reproduce_command("ch02", profile, workload, [], "ch02", None, None, 0)
    assert "--workers 3" in open_loop_reproduce("ch02", profile, workload, None, None, [], "ch02", 3)
    assert (ceiling_label(0), ceiling_label(2)) == ("ceiling", "ceiling-workers2")


def test_each_worker_gets_a_core_where_the_machine_has_one_to_spare():
    profiles = build_profiles()
    cpu, gpu = profiles["cpu"], profiles["gpu"]
    assert core_plan_for(cpu, 0, list(range(16))) == cpu.core_plan(list(range(16))) == ([0], [15])
    assert core_plan_for(cpu, 1, list(range(16))) == ([0], [15])
    assert core_plan_for(cpu, 2, list(range(16))) == ([0], [14, 15])
    assert core_plan_for(gpu, 2, list(range(16))) == (list(range(14)), [14, 15])
    assert core_plan_for(cpu, 2, [0, 1]) == ([0], [1])  # two cores: the server keeps one, the workers share the other
    assert core_plan_for(cpu, 4, [0, 1, 2]) == ([0], [1, 2])
    assert core_plan_for(cpu, 2, [0]) == (None, None)


# ---------------------------------------------------------------- the merge


def record(start: float, latency: float, ok: bool = True) -> list:
    return [start, latency, 200 if ok else 0, ok, 32 if ok else 0, None if ok else "no answer", None, 16]


def worker_run(index: int, requests: list[list], stopping_at: float = 20.0, **extra) -> dict:
    return {"role": "worker", "worker_index": index, "steady_at": 1.0, "stopping_at": stopping_at,
            "stopped_by": "time_limit", "requests": requests, "open_rate": None, "first_arrival_at": None,
            "dropped_at": [], "unfinished_at": [], "max_outstanding_seen": 0, "open_loop_done": False, **extra}


def test_merge_takes_the_masters_window_and_every_workers_requests():
    master = {"role": "master", "steady_at": 2.0, "stopping_at": 12.0, "stopped_by": "request_target", "requests": [],
              "open_rate": None, "first_arrival_at": None, "dropped_at": [], "unfinished_at": [],
              "max_outstanding_seen": 0}
    zero = [record(1.0, 0.5), record(3.0, 0.5), record(5.0, 0.5, ok=False)]
    one = [record(2.5, 1.0), record(4.0, 1.0)]
    merged = merge_runs(master, [worker_run(0, zero, stopping_at=12.1), worker_run(1, one, stopping_at=12.2)])
    assert (merged["steady_at"], merged["stopping_at"], merged["stopped_by"]) == (2.0, 12.0, "request_target")
    assert merged["requests"] == sorted(zero + one, key=lambda r: r[0]) and merged["requests_per_worker"] == [3, 2]
    # in flight: 2.5-3.5 and 3.0-3.5 overlap, 4.0-5.0 and 5.0-5.5 only touch
    assert merged["max_outstanding_seen"] == 2


def test_merge_of_an_open_loop_counts_every_workers_arrivals():
    master = {"role": "master", "steady_at": None, "stopping_at": 30.0, "stopped_by": "time_limit", "requests": [],
              "open_rate": 10.0, "first_arrival_at": None, "dropped_at": [], "unfinished_at": [],
              "max_outstanding_seen": 0}
    zero = worker_run(0, [record(10.0, 3.0), record(10.5, 0.1)], open_rate=5.0, first_arrival_at=10.0,
                      dropped_at=[11.0], unfinished_at=[12.0], open_loop_done=True, stopping_at=13.0)
    one = worker_run(1, [record(10.2, 3.0)], open_rate=5.0, first_arrival_at=10.0, dropped_at=[11.5],
                     open_loop_done=True, stopping_at=13.0)
    merged = merge_runs(master, [zero, one])
    assert merged["first_arrival_at"] == 10.0 and merged["dropped_at"] == [11.0, 11.5] and merged["unfinished_at"] == [12.0]
    # 10.0-13.0, 10.2-13.2 and the unanswered one from 12.0 on: three at once (10.5-10.6 makes three earlier too)
    assert merged["max_outstanding_seen"] == 3 and merged["requests_per_worker"] == [2, 1]


def test_merge_refuses_a_worker_that_did_not_last_the_level():
    master = {"steady_at": 2.0, "stopping_at": 12.0, "stopped_by": "time_limit", "requests": [], "open_rate": None}
    with pytest.raises(RuntimeError, match="worker 1 stopped before the master"):
        merge_runs(master, [worker_run(0, [], stopping_at=12.1), worker_run(1, [], stopping_at=8.0)])
    unfinished_open_loop = worker_run(0, [], open_rate=5.0, open_loop_done=False)
    with pytest.raises(RuntimeError, match="worker 0 stopped before its open loop was over"):
        merge_runs({**master, "open_rate": 10.0}, [unfinished_open_loop])


def test_max_in_flight_counts_unanswered_arrivals_to_the_end():
    assert max_in_flight([], []) == 0
    assert max_in_flight([record(0.0, 1.0), record(1.0, 1.0)], []) == 1  # one answer, then the next arrival
    assert max_in_flight([record(0.0, 1.0)], [0.5, 5.0]) == 2


# ---------------------------------------------------------------- the report shows the mode


def test_results_record_and_the_report_shows_how_locust_ran(tmp_path: Path):
    single = synthetic_result("ch02", [SyntheticLevel(8, 25, 320, 360, loadgen_cpu_percent=90.0)])
    assert "distributed" not in environment_line({"ch02": single})  # one process goes unsaid, as before
    assert any("90 % of its core" in w for w in warnings_for({"ch02": single}))

    distributed = synthetic_result("ch02", [SyntheticLevel(8, 25, 320, 360, loadgen_cpu_percent=150.0)])
    distributed.config.load_generator = LoadGenerator(workers=2)
    distributed.environment.loadgen_cores = [2, 3]
    assert load_result(save_result(distributed, tmp_path)).config.load_generator.workers == 2
    assert "Locust distributed: a master and 2 workers" in environment_line({"ch02": distributed})
    # 150 % summed over two workers on two cores is not a saturated client
    assert not any("load generator used" in w for w in warnings_for({"ch02": distributed}))
    mixed = warnings_for({"ch02": distributed, "ch01": synthetic_result("ch01", [SyntheticLevel(8, 20, 300, 400)])})
    assert any("different load generators" in w for w in mixed)

    for workers, qps in ((0, 900.0), (2, 1500.0)):
        ceiling = synthetic_result("ceiling", [SyntheticLevel(32, qps, 5, 9)], label=ceiling_label(workers))
        ceiling.config.load_generator = LoadGenerator(workers=workers)
        save_result(ceiling, tmp_path)
    line = ceiling_line(tmp_path)
    assert line.startswith("Harness ceiling (Locust against an instant endpoint): 900 QPS at 32 users")
    assert "Harness ceiling (Locust distributed, a master and 2 workers, against an instant endpoint): 1,500 QPS" in line

    sweep = synthetic_open_loop("ch02")
    sweep.config.load_generator = LoadGenerator(workers=2)
    assert any("each worker at 1/2 of the rate" in text for text in render_open_loop({"ch02": sweep}))
    assert not any("Load generator" in text for text in render_open_loop({"ch02": synthetic_open_loop("ch02")}))


# ---------------------------------------------------------------- for real, against the instant server


def locust_processes_of(directory: Path) -> list[psutil.Process]:
    """Every live Locust process started for ``directory`` (found by the records path in its environment)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "locust" in " ".join(process.info["cmdline"] or []) and str(directory) in process.environ().get(
                "SFS_BENCH_RECORDS", ""
            ):
                found.append(process)
        except psutil.Error:
            continue
    return found


def in_window(run: dict, start: float, end: float) -> list[list]:
    return [r for r in run["requests"] if start <= r[0] + r[1] <= end]


@pytest.mark.slow  # real Locust master and two workers: make test-slow; the level's bookkeeping has unit tests above
def test_two_workers_requests_all_reach_the_level(tmp_path: Path):
    plan = closed_plan(workers=2, users=4, seconds=1.5)
    with running_module("benchmarks.harness.trivial_server", name="instant") as server:
        level = run_level(server.url, plan, server_pid=server.pid, loadgen_cores=None, work_dir=tmp_path)
    master = json.loads((tmp_path / "level-4.records.json").read_text())
    workers = [json.loads((tmp_path / f"level-4.worker{i}.records.json").read_text()) for i in (0, 1)]
    assert master["role"] == "master" and master["requests"] == [] and sorted(master["steady_by_worker"]) == ["0", "1"]
    assert [w["worker_index"] for w in workers] == [0, 1]
    # the level counts exactly the requests the two workers finished inside the master's window, each its share
    counted = [in_window(w, master["steady_at"], master["stopping_at"]) for w in workers]
    assert all(len(share) > 0 for share in counted)
    assert level.requests_ok + level.requests_failed == sum(len(share) for share in counted)
    assert level.requests_failed == 0 and level.latency_sample == level.requests_ok > 0
    assert level.window_s == pytest.approx(master["stopping_at"] - master["steady_at"])
    assert level.loadgen_cpu_percent is not None  # summed over the three processes
    assert not locust_processes_of(tmp_path)


@pytest.mark.slow  # the rate split is checked above on every run; this is its real run
def test_two_workers_share_the_open_loops_rate(tmp_path: Path):
    plan = open_plan(workers=2, rate=40.0, max_outstanding=32)
    with running_module("benchmarks.harness.trivial_server", name="instant") as server:
        level = run_open_level(server.url, plan, server_pid=server.pid, loadgen_cores=None, work_dir=tmp_path)
    workers = [json.loads((tmp_path / f"rate-40.worker{i}.records.json").read_text()) for i in (0, 1)]
    assert [w["open_rate"] for w in workers] == [20.0, 20.0]
    assert workers[0]["first_arrival_at"] == workers[1]["first_arrival_at"]  # one start for both clocks
    # 80 arrivals expected in the window over both workers; a Poisson count lies within 5 standard deviations
    assert 35 <= level.arrivals <= 125 and level.requests_ok == level.arrivals and level.requests_failed == 0
    assert all(len(w["requests"]) > 0 for w in workers)
    assert level.max_outstanding_seen <= 32
    assert not locust_processes_of(tmp_path)


@pytest.mark.slow  # real processes: make test-slow
def test_a_worker_that_dies_ends_the_level_and_every_process(tmp_path: Path):
    plan = closed_plan(workers=2, users=4, seconds=20.0)

    def kill_worker_once_running() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for process in locust_processes_of(tmp_path):
                try:
                    if process.environ().get("SFS_BENCH_WORKER_INDEX") == "1":
                        time.sleep(2.0)  # let it connect and start its users
                        process.kill()
                        return
                except psutil.Error:
                    continue
            time.sleep(0.1)

    killer = threading.Thread(target=kill_worker_once_running)
    with running_module("benchmarks.harness.trivial_server", name="instant") as server:
        killer.start()
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="worker 1 exited"):
            run_level(server.url, plan, server_pid=server.pid, loadgen_cores=None, work_dir=tmp_path)
        killer.join()
    assert time.monotonic() - began < plan.max_s  # stopped at once, not at the level's end
    assert not locust_processes_of(tmp_path)


@pytest.mark.slow  # the flag that makes the master give up is checked on every run, above
def test_a_master_whose_workers_never_connect_gives_up(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(loadgen, "EXPECT_WORKERS_MAX_WAIT_S", 2)
    real_worker_command = loadgen.worker_command
    nowhere = loadgen.Distribution(workers=2, port=loadgen.free_port())  # nobody listens there
    monkeypatch.setattr(loadgen, "worker_command", lambda user_class, _distribution: real_worker_command(user_class, nowhere))
    with running_module("benchmarks.harness.trivial_server", name="instant") as server:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="master exited"):
            run_level(server.url, closed_plan(workers=2, users=2), server_pid=server.pid, loadgen_cores=None,
                      work_dir=tmp_path)
    assert time.monotonic() - began < 20
    assert not locust_processes_of(tmp_path)


@pytest.mark.slow
def test_a_level_past_its_time_limit_stops_every_process(tmp_path: Path):
    processes = locust_processes(URL, closed_plan(workers=2, users=2, seconds=60.0), tmp_path / "level-2")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish the level"):
        # the harness's bound on the level, shorter than the level itself
        loadgen._run_locust(processes, server_pid=psutil.Process().pid, loadgen_cores=None, timeout_s=3.0,
                            what="the level", poller=None)
    assert time.monotonic() - began < 10
    assert not locust_processes_of(tmp_path)


HARNESS_FOR_A_MINUTE = """
import sys
from pathlib import Path
from benchmarks.harness.loadgen import LevelPlan, run_level
from benchmarks.harness.server_process import running_module
from benchmarks.harness.workload import get_workload
plan = LevelPlan(users=2, min_s=60, max_s=60, target_requests=0, workload=get_workload("default"), seed=1234,
                 vocab_size=258, request_timeout_s=10.0, workers=2)
with running_module("benchmarks.harness.trivial_server", name="instant") as server:
    run_level(server.url, plan, server_pid=server.pid, loadgen_cores=None, work_dir=Path(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "harness-killed"])
def test_no_locust_process_outlives_an_interrupted_harness(tmp_path: Path, how):
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS_FOR_A_MINUTE, str(tmp_path)], cwd=REPO_ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a Ctrl-C reaches Python even from a batch job
    )
    its_children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while len(locust_processes_of(tmp_path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(locust_processes_of(tmp_path)) == 3  # the master and its two workers run
        time.sleep(3.0)  # the workers connect and load the server
        its_children = psutil.Process(harness.pid).children()
        harness.send_signal(how)
        harness.wait(timeout=30)
        deadline = time.monotonic() + 10  # SIGKILL: the kernel's parent-death signal takes a moment
        while locust_processes_of(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not locust_processes_of(tmp_path)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        for child in its_children:  # a killed harness cannot stop its instant server (the test's own cleanup)
            try:
                child.kill()
            except psutil.Error:
                pass
