"""Chapter 8 served from another commit's tree against this one, side by side: did a change pay where it is served?

Each round starts chapter 8 from each tree in turn (the order reversed every other round), pinned as
the climb's ``cpu`` profile pins it, and measures it with the vLLM peer study's client (OpenAI's
completions route, ``--users`` closed-loop users for ``--duration-s``, whole answers then streamed).
The base tree is a git worktree of the commit before the change; both run on this venv's Python:

    git worktree add /tmp/base ddd6c30
    python -m benchmarks.studies.ch08_shared_prefix.served_ab --base /tmp/base \\
        > benchmarks/studies/ch08_shared_prefix/served-ab-bf16mlp-default.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import benchmarks.harness.server_process as server_process
from benchmarks.harness.streaming import harness_settings
from benchmarks.studies.vllm_peer.peer import measure

ANSWERS = ("whole", "stream")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a worktree of the commit to compare with")
    parser.add_argument("--workload", default="default", choices=("default", "mixed", "shared-prefix"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    harness, flags, env = harness_settings("cpu")  # pins this client to the load generator's cores
    trees = {"base": args.base.resolve(), "this": server_process.REPO_ROOT}
    qps: dict[tuple[str, str], list[float]] = {(tree, answers): [] for tree in trees for answers in ANSWERS}
    try:
        for index in range(args.rounds):
            for tree in list(trees) if index % 2 == 0 else list(trees)[::-1]:
                server_process.REPO_ROOT = trees[tree]  # where running_module starts the server
                with server_process.running_module("chapters.ch08_continuous_batching", flags, name="ch08", env=env,
                                                   cpu_cores=harness["server_cores"], startup_timeout_s=600.0) as server:
                    for answers in ANSWERS:
                        record = measure(server.url, args, args.workload, answers == "stream", None)
                        qps[(tree, answers)].append(record["qps"])
                        print(f"round {index + 1} {tree} {answers}: {record['qps']:.1f} QPS", file=sys.stderr, flush=True)
    finally:
        server_process.REPO_ROOT = trees["this"]
    print(f"chapter 8 served, {args.workload}, {args.users} users, {args.duration_s:g} s a round; {harness['cpu']}; "
          f"this tree {harness['git_commit'][:7]}{' (uncommitted changes)' if harness['git_dirty'] else ''} against {args.base}")
    for answers in ANSWERS:
        base, this = qps[("base", answers)], qps[("this", answers)]
        print(f"  {answers:<6} base {[round(q, 1) for q in base]}  this {[round(q, 1) for q in this]}  "
              f"this / base: {statistics.median(this) / statistics.median(base):.3f} of the medians, "
              f"rounds {[round(t / b, 2) for b, t in zip(base, this)]}")


if __name__ == "__main__":
    main()
