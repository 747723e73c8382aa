"""Write the notebooks of this folder from the cells below (maintainers' tool; the notebooks are the product).

    python notebooks/build.py            # rewrite every notebook, without outputs
    python notebooks/build.py ch07_production   # rewrite only those named (the others keep their outputs)
    make notebooks                       # then execute them in place against the reference results

Each notebook only reads results and plots them (``benchmarks/report/notebook_plots/``); it measures
nothing and never imports Locust. Edit a notebook's cells here, not in the .ipynb, so they stay alike.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''%matplotlib inline
import os
import sys
from pathlib import Path

# Make the repository importable when the notebook runs from notebooks/ without `pip install -e .`.
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "benchmarks" / "report" / "__init__.py").exists())
sys.path.insert(0, str(ROOT))

from IPython.display import Markdown, display

from benchmarks.report import notebook_plots as plots
from benchmarks import report
from benchmarks.report.notebook_plots import say, show'''

PARAMETERS = '''# Parameters. By default: the committed reference results (benchmarks/reference/cpu/).
# To plot your own run instead, set SFS_RESULTS_DIR before starting Jupyter, e.g.
#   SFS_RESULTS_DIR=benchmarks/results/cpu jupyter lab notebooks/
# or assign RESULTS_DIR here.
RESULTS_DIR = plots.results_dir()
closed, long, open_loop = plots.load_all(RESULTS_DIR)
print(f"{len(closed)} closed-loop runs, {len(long)} long-workload runs, {len(open_loop)} open-loop sweeps in {plots.shown_path(RESULTS_DIR)}")'''

# Chapters 7 and 8 read files of their own recorders (not the climb's results): just the directory.
OWN_FILES_PARAMETERS = '''# Parameters. By default: the committed reference results (benchmarks/reference/cpu/).
# To plot your own run instead, set SFS_RESULTS_DIR before starting Jupyter, e.g.
#   SFS_RESULTS_DIR=benchmarks/results/cpu jupyter lab notebooks/
# or assign RESULTS_DIR here.
RESULTS_DIR = plots.results_dir()
print(f"reading {plots.shown_path(RESULTS_DIR)}")'''
OWN_FILES_TAIL = "\n\nWhere these results hold no recording, each plot says so and names the command that makes it."

INTRO_TAIL = (
    "\n\nA plot whose data these results do not hold (stage timings, batch sizes and open-loop sweeps are recorded "
    "only by the current harness) says so and names the command that records it."
)


def notebook(title: str, intro: str, cells: list[tuple[str, str]], look_at: str, parameters: str = PARAMETERS,
             intro_tail: str = INTRO_TAIL) -> nbformat.NotebookNode:
    """``cells``: (markdown, code) pairs after the setup and ``parameters`` cells; ends with the "what to look at" cell."""
    built = [new_markdown_cell(f"# {title}\n\n{intro}{intro_tail}"), new_code_cell(SETUP), new_code_cell(parameters)]
    for markdown, code in cells:
        if markdown:
            built.append(new_markdown_cell(markdown))
        if code:
            built.append(new_code_cell(code))
    built.append(new_markdown_cell(f"## What to look at\n\n{look_at}"))
    book = new_notebook(cells=built)
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    book.metadata["language_info"] = {"name": "python"}
    return book


def real_model_cell(labels: tuple[str, ...]) -> tuple[str, str]:
    """The chapter's step again on a real model: the climb serving SmolLM2-135M-Instruct."""
    return ("## The same step on a real model\n\nThe climb serving SmolLM2-135M-Instruct (`make climb WEIGHTS=smollm2`; "
            "`SFS_REAL_MODEL_RESULTS_DIR` plots your own): the same loads, a model forty times the parameters.",
            f"show(plots.plot_real_model_step, {labels!r})")


NOTEBOOKS = {
    "ch01_flask_sync": notebook(
        "Chapter 1: a synchronous server, and the queue nobody shows",
        "Flask on gunicorn, one request at a time per worker. Every other client waits in the kernel's accept "
        "backlog, where neither the server's log nor its `timings_ms` can see it.",
        [
            ("## Latency grows like a queue\n\nThe measured P50 against the number of users, beside `users × the "
             "one-user P50`: the latency of a pure queue in front of one server.",
             'show(plots.plot_queue_nobody_shows, closed, ("ch01", "ch01-workers"))'),
            ("## The time the client sees against the time the server computes\n\nThe server's own `total` covers "
             "only the time after it accepted the connection; the client's clock starts when it sent the request.",
             'show(plots.plot_client_vs_server, closed.get("ch01"))'),
            real_model_cell(('ch01',)),
        ],
        "- In the first plot, the measured P50 follows the dotted `users × P50 alone` line: each extra user waits "
        "for one more request to finish before its own starts. A second worker (`ch01-workers`) halves the queue "
        "only if there is a second core to run it.\n"
        "- In the second plot, the server's `total` stays near the one-user time at every load while the client's "
        "time grows: the difference is the queue in the kernel's backlog, which no server-side metric shows. "
        "Points far above the diagonal are requests that waited outside the server.\n"
        "- That is why chapter 2 moves the waiting inside the server, where it can be counted and managed.",
    ),
    "ch02_fastapi_async": notebook(
        "Chapter 2: async serving, sync against async",
        "FastAPI on uvicorn: the event loop keeps accepting while inference runs off the loop, one at a time.",
        [
            ("## Latency and throughput against concurrency",
             'show(plots.plot_latency_and_qps, closed, ("ch01", "ch02"), "Sync (ch01) against async (ch02)")'),
            ("## The same load for both\n\nP50 / P99 at every concurrency level both chapters measured (never one "
             "chapter's saturation against the other's).",
             'pair = {k: closed[k] for k in ("ch01", "ch02") if k in closed}\n'
             'lines = report.render_same_load(pair)\n'
             'display(Markdown("\\n".join([*lines, "", report.environment_line(pair)]) if lines\n'
             '                 else "> Both ch01 and ch02 are needed for this table."))'),
            ("## Where one request's time goes\n\nThe server's own stages (`timings_ms`), stacked, at each load.",
             'show(plots.plot_stage_breakdown, closed.get("ch02"))'),
            real_model_cell(('ch01', 'ch02')),
        ],
        "- On one core, async alone does not compute faster: throughput stays near chapter 1's, because one "
        "inference still runs at a time. The article's jump (its GPU) came from overlapping I/O with a device.\n"
        "- At the same load the two latencies are close; what changed is *where* requests wait: now in the "
        "server's `queue` stage, visible in the stacked bars, instead of the kernel's backlog.\n"
        "- The `queue` bar grows with users while `inference` stays flat: the server is busy, not slow. Chapter 3 "
        "spends that queue on batching.",
    ),
    "ch03_dynamic_batching": notebook(
        "Chapter 3: dynamic batching",
        "A request queue and a batcher with a time window and minimum/maximum batch sizes: requests that wait "
        "together are computed together.",
        [
            ("## The batch sizes the server formed\n\nAs `/stats` counted them, per load level (share of requests "
             "computed in batches of each size).", 'show(plots.plot_batch_sizes, closed.get("ch03"))'),
            ("## The prompt pass: tokens computed against tokens needed\n\nThe textbook prompt pass (`--prefill "
             "padded`) computes every prompt of a batch at the longest one's length; chapter 3's default "
             "(`--prefill by_length`) runs prompts of equal length together and computes no padding. The plot "
             "reads which one the run used from its server flags, and shows what a padded pass would have "
             "computed for the measured batch sizes (expected over the workload's length mix).",
             'show(plots.plot_padding, closed.get("ch03"))'),
            ("## The window's trade-off\n\nWhat batching costs one request alone, against what it buys "
             "under load; below the plot, the one-user figures and the server's stages that make them up.",
             'show(plots.plot_window_tradeoff, closed, "ch02", "ch03")\nsay(plots.window_cost, closed, "ch02", "ch03")'),
            ("## Where the time goes in a batching server",
             'show(plots.plot_stage_breakdown, closed.get("ch03"))'),
            real_model_cell(('ch02', 'ch03')),
        ],
        "- Batch sizes follow the load: at one user every batch holds one request; at high concurrency most "
        "requests ride in large batches, which is where the throughput comes from.\n"
        "- A padded prompt pass would waste more as batches grow: the larger the batch, the likelier it holds one "
        "long prompt that every other row is padded to. With `--prefill by_length` the prompt pass computes none of "
        "it; the decode steps still attend over the padded cache (masked), which chapter 8's packed steps remove.\n"
        "- At one user, the sentence under the trade-off plot splits the difference from chapter 2: the `queue` "
        "stage is what the window itself costs; the rest is the batched code path (its `prefill` and `decode` "
        "against chapter 2's `inference`). Under load, the right panel shows what batching buys.",
    ),
    "ch04_memory_pool": notebook(
        "Chapter 4: a pre-allocated KV-cache pool and admission control",
        "The cache lives in blocks of one pool allocated at start; each batch reserves one range of it for its "
        "padded length; admission queues or rejects (429) when too many requests wait, or offloads to a CPU "
        "fallback.",
        [
            ("## Per-step time against sequence length (`long` workload)\n\nDecode time per generated token at "
             "the lowest load: the `torch.cat` cache (chapter 3) copies the whole cache at every step, the pool "
             "writes one slot.", "show(plots.plot_step_time, long)"),
            ("## The long workload under load", "show(plots.plot_long_workload, long)\nsay(plots.long_workload_ratios, long)"),
            ("## The pool over time under load\n\nBlocks in use and the share of reserved slots actually written, "
             "as `/stats` reported them every half second.", 'show(plots.plot_pool_over_time, closed.get("ch04"))'),
            ("## Rejections (429) and fallbacks", "show(plots.plot_rejections, closed)"),
            real_model_cell(('ch03', 'ch04')),
        ],
        "- At one user, compare the two medians at each prompt length with the scatter around them: one row's cache "
        "of this tiny model (at most 128 + 256 positions) is cheap to copy next to the rest of a step, so a gap, if "
        "any, is small there. The copy grows with rows x positions: under load the batches are wide, and the sentence "
        "under the long-workload plot gives the pool's tokens/s over `torch.cat`'s at each load.\n"
        "- Reserved is not all written: each batch reserves one range for its padded length (the longest prompt "
        "plus the most new tokens any of its requests asked for), so rows with shorter prompts or answers leave "
        "slots empty, and ranges round up to whole blocks. That share is the price of never running out "
        "mid-generation.\n"
        "- 429s appear only once the queue in front of the pool is full: they protect the P99 of the requests "
        "that were admitted. Fallback bars show requests served off the pool instead of refused.",
    ),
    "ch05_inference_engine": notebook(
        "Chapter 5: engines and precision",
        "The same model run by different engines (eager PyTorch, torch.compile, ONNX Runtime, ...) at different "
        "precisions, each with a measured accuracy cost.",
        [
            ("## Accuracy against throughput\n\nFrom chapter 5's trade-off table "
             "(`benchmarks/reference/ch05-tradeoffs/latest.json`, or `$SFS_TRADEOFFS_FILE`).",
             "show(lambda: plots.plot_tradeoffs(plots.load_tradeoffs()))"),
            ("## The table itself",
             'table_md = Path(os.environ.get("SFS_TRADEOFFS_FILE") or ROOT / "benchmarks/reference/ch05-tradeoffs/latest.json").with_suffix(".md")\n'
             'display(Markdown(table_md.read_text() if table_md.exists() else f"> No table at {plots.shown_path(table_md)}."))'),
            ("## In the server: chapter 4 against chapter 5 and its variants",
             'show(plots.plot_latency_and_qps, closed, ("ch04", "ch05", "ch05-fp32", "ch05-onnxruntime"), '
             '"Chapter 5 in the server, beside chapter 4")'),
            real_model_cell(('ch04', 'ch05')),
        ],
        "- Up and to the right is better in the first panel: a precision that gains throughput without losing "
        "accuracy is free; one that loses accuracy must buy a lot of speed to be worth it.\n"
        "- Compare the precisions on your machine: on a CPU without native fp16 arithmetic fp16 is slower than "
        "fp32, and bf16 only pays where the CPU has bf16 instructions and the batch is large (the calibration in "
        "the climb notebook records this machine's bf16 rate).\n"
        "- In the server, the engine's gain shows at high concurrency (large batches), less at one user.",
    ),
    "ch06_tuned_batching": notebook(
        "Chapter 6: tuned batching and the adaptive window",
        "An autotuner sweeps the batcher's knobs with the harness; an adaptive window stops waiting when "
        "nobody else is coming.",
        [
            ("## The tuner's sweep\n\nFrom `chapters/ch06_tuned_batching/tuned.json` (or `$SFS_TUNED_FILE`).",
             "show(lambda: plots.plot_tuner_heatmap(plots.load_tuned()))"),
            ("## One user, with and without the adaptive window",
             'show(plots.plot_one_user_latency, closed, ("ch05", "ch06"))'),
            ("## Under load", 'show(plots.plot_latency_and_qps, closed, ("ch05", "ch06"), "Chapter 5 against chapter 6")'),
            real_model_cell(('ch05', 'ch06')),
        ],
        "- The heatmap is flat near its top: several settings are within noise of the chosen one, so the tuner's "
        "choice matters less than avoiding the bad corner (small batches, long windows).\n"
        "- At one user, the adaptive window removes the wait for company that never comes: chapter 6's latency "
        "there should sit at or below chapter 5's.\n"
        "- Under load both windows fill batches anyway; the gain there comes from the tuned batch limits.",
    ),
    "ch07_production": notebook(
        "Chapter 7: production, the drain around a SIGTERM and the leak check",
        "Chapter 6's server wrapped in what keeps it alive: on SIGTERM it stops being ready, refuses new work "
        "with 503 + `Retry-After`, finishes what it accepted, then exits; a leak check sends many requests, a "
        "share of them failing, and watches memory per request.",
        [
            ("## The drain timeline\n\nA real chapter 7 server under a closed-loop load; SIGTERM at 0 s. Top: "
             "the requests in flight as `/stats` counted them (what the drain waits for); middle: `/readyz`; "
             "bottom: every client request from its start to its end, coloured by what it got. Recorded by "
             "`python -m benchmarks.studies.drain_timeline.drain_timeline` into `ch07/drain-timeline.json`.",
             "show(lambda: plots.plot_drain_timeline(plots.load_drain_timeline(RESULTS_DIR)))"),
            ("## The leak check's memory curve, with and without the planted leak\n\n"
             "`--leak-lesson leaky` keeps a per-request intermediate tensor when the request fails (the "
             "article's bug: released on the success path only); `fixed` releases it in `finally`. Memory is "
             "measured after the warm-up, then after every share of the requests. Recorded by "
             "`python -m chapters.ch07_production.leakcheck --samples N --out ...` into `ch07/leak-<lesson>.json`.",
             "show(lambda: plots.plot_leak_curves(plots.load_leak_curves(RESULTS_DIR)))"),
            real_model_cell(('ch06', 'ch07')),
        ],
        "- Readiness turns 503 at once on SIGTERM, before anything else: a load balancer stops sending traffic "
        "while the requests already accepted are still running.\n"
        "- The in-flight count falls to zero as those requests finish; every green bar that started before 0 s "
        "ends with an answer, none is cut off. Only then does the process exit; past `--drain-timeout-s` it would "
        "exit anyway and log how many it cut off.\n"
        "- New requests during the drain get 503 in milliseconds (orange crosses), not a hung connection; once "
        "the process is gone they get no connection at all (red): a client must retry elsewhere.\n"
        "- In the leak curves, `leaky` grows with the failed requests (each keeps its buffer) and crosses the "
        "threshold slope; `fixed` stays flat. The growth is per request, not per second: that is the article's "
        "first test of a leak. RSS is shown, not judged: the allocator keeps freed pages.",
        parameters=OWN_FILES_PARAMETERS, intro_tail=OWN_FILES_TAIL,
    ),
    "ch08_continuous_batching": notebook(
        "Chapter 8: continuous batching and streaming, against chapter 6",
        "Chapter 8 schedules every decode step anew: a finished request leaves the batch at once and a waiting "
        "one joins at the next step, and each token is streamed as soon as its step ends. Chapter 6 batches "
        "whole requests: a batch is held by its longest member, and nothing is sent before the end.",
        [
            ("## Time to first token, time per output token, whole request\n\n"
             "`python -m benchmarks.harness.streaming compare --chapters ch06 ch08` at the same number of closed-loop "
             "users, on the `mixed` workload (new tokens 8 to 256, most answers short) and the climb's `default` "
             "(32 new tokens each). Definitions as vLLM's benchmark: TTFT from sending to the first token; TPOT "
             "= (E2E - TTFT) / (tokens - 1); E2E to the last byte.",
             "show(lambda: plots.plot_streaming_latencies(plots.load_streaming(RESULTS_DIR)))"),
            ("## Throughput at equal load", "show(lambda: plots.plot_streaming_throughput(plots.load_streaming(RESULTS_DIR)))"),
            ("## Where a step's time goes\n\nThe engine thread times each phase of every step (`/stats` keeps the last "
             "256; the harness records them at the end of each load level): `schedule` (the scheduler's plan), `prepare` "
             "(the model runner packing ids, positions, the slot mapping and the attention metadata), `model` (ONE packed "
             "forward) and `update` (tokens appended, finished sequences retired). Right: what each step of the highest "
             "load computed, decode rows and prompt-chunk tokens in the same forward pass.",
             "show(lambda: plots.plot_step_split(plots.load_step_records(RESULTS_DIR)))"),
            ("## Prefix caching on and off\n\n`python -m benchmarks.harness.streaming compare --variant "
             "caching-on=ch08:--prefix-caching=on --variant caching-off=ch08:--prefix-caching=off`, one file per workload: "
             "`shared-prefix` (a few long prefixes shared by every request, short distinct suffixes) is where caching skips "
             "most of every prompt; `default` and `mixed` share nothing, so there it can only cost. Left: TTFT (P50 over "
             "P99); right: completed requests per second at the same users.",
             "show(lambda: plots.plot_prefix_caching(plots.load_prefix_caching(RESULTS_DIR)))"),
            real_model_cell(('ch07', 'ch08')),
        ],
        "- TTFT is where streaming shows: chapter 8's first token comes after one prefill step, chapter 6's "
        "(which does not stream) only with the whole answer, so its TTFT is its E2E.\n"
        "- On `mixed`, a short answer in chapter 6 waits for the longest request of its batch; in chapter 8 it "
        "leaves the batch when done. Compare the E2E P50 there: the gap is the cost of request-level batches.\n"
        "- On `default` every answer has the same length, so holding the batch costs little: the two chapters "
        "are closer, and what remains is the per-step scheduling overhead of chapter 8.\n"
        "- QPS at the same users: when chapter 8 finishes short requests sooner, its clients send their next one "
        "sooner, and its requests/s rises; tokens/s tells whether the engine itself did more work.\n"
        "- In the step split, `model` should be nearly all of a step: what the scheduler and the runner add around "
        "the forward pass is the overhead a Python server pays per step, the same at 8 users as at 64.\n"
        "- With prefix caching, a shared prefix is computed once and then found: `shared-prefix`'s requests/s rises "
        "because each step carries a few suffix tokens instead of whole prompts. Its TTFT falls less than its prompt "
        "work does: a first token still waits for the step it arrived during and the step that computes its suffix, "
        "and caching shortens those steps without removing them (`python -m benchmarks.studies.ttft_split.ttft_split` "
        "shows the server's side).\n",
        parameters=OWN_FILES_PARAMETERS, intro_tail=OWN_FILES_TAIL,
    ),
    "ch09_scale_out": notebook(
        "Chapter 9: chapter 8's server past one process, on Ray Serve",
        "Replicas of chapter 8's server behind Serve's proxy, with the project's contract kept at the edge "
        "(one replay of a request whose replica died before answering, the contract's error otherwise). Here: "
        "what a client sees when a replica is killed under load, how autoscaling follows a step of load, one "
        "replica against two under each router, what Serve's path costs an answer, and a simulation of 1 to 64 replicas.",
        [
            ("## The failure drill\n\n`python -m benchmarks.studies.scale_out_timeline.scale_out_timeline drill`: two replicas, eight "
             "closed-loop clients (every other request a stream), one replica's process SIGKILLed at 0 s. Top: "
             "Serve's count of running replicas and the replica processes alive; middle: answers per second and "
             "the P99 of each second's answers; bottom: every request, coloured by what its client got.",
             'show(lambda: plots.plot_failure_drill(plots.load_scale_out(RESULTS_DIR, "failure-drill.json")))'),
            ("## The same drill with chapter 8's defaults\n\nEvery replica measures its engine and attention "
             "backends at start and compiles flex attention: the replacement takes longer to serve.",
             'show(lambda: plots.plot_failure_drill(plots.load_scale_out(RESULTS_DIR, "failure-drill-chapter-defaults.json")))'),
            ("## The same drill with a warm spare\n\n`--spare-replicas 1`: three replicas where the load needs two. The kill "
             "takes one; the two survivors are the capacity the load needs while the replacement starts, so the line of "
             "replicas the load needs never drops below two (the first of three runs; all three in the chapter's RESULTS.md).",
             'show(lambda: plots.plot_failure_drill(plots.load_scale_out(RESULTS_DIR, "failure-drill-spare-1.json")))'),
            ("## Autoscaling under a step load\n\n`python -m benchmarks.studies.scale_out_timeline.scale_out_timeline autoscale`: "
             "Serve's autoscaler on requests held per replica, with short delays, while the clients step up and down.",
             'show(lambda: plots.plot_autoscale_timeline(plots.load_scale_out(RESULTS_DIR, "autoscale-timeline.json")))'),
            ("## One replica against two, and the routers\n\n`python -m benchmarks.studies.replicas_and_routers.scale_out_compare`: chapter 8 "
             "alone, one replica behind Serve's proxy, two replicas under Serve's `pow2` and under `least-tokens`, "
             "on the `mixed` workload; medians of the rounds.",
             'show(lambda: plots.plot_replicas_and_routers(plots.load_scale_out(RESULTS_DIR, "replicas-and-routers.json")))'),
            ("## What Serve's path costs an answer\n\nThe serve-path comparisons (`scale_out_compare`, chapter 9's RESULTS.md): "
             "chapter 8 alone, one replica behind Serve's proxy, the same replica with no Python proxy (direct ingress, a "
             "trial), and both sides with each answer in runs of 64 tokens (about two messages an answer). Each bar is a "
             "configuration's CPU per answer, by process; above it, against chapter 8 alone written in the same runs.",
             'show(lambda: plots.plot_serve_path_costs({workload: plots.load_scale_out(RESULTS_DIR, f"serve-path-{workload}.json")\n'
             '                                          for workload in ("default", "mixed")}))'),
            ("## 1 to 64 replicas, simulated\n\n`python -m benchmarks.studies.scale_out_simulation.sweep`: chapter 8's scheduler "
             "with step times measured from its engine, as replicas behind each router, under Poisson arrivals at 85 % "
             "and 95 % of what the replicas can serve (the `mixed` workload). What it assumes is listed in the file and "
             "in the chapter's README.",
             'show(lambda: plots.plot_simulated_scaling(plots.load_scale_out(RESULTS_DIR, "simulation.json")))'),
        ],
        "- In the drill, only requests in flight at the kill are touched: whole answers come back replayed "
        "(blue), streams end with the contract's error (orange); nothing is red.\n"
        "- Capacity comes back when the replacement is running: the gap between the kill and that line is "
        "start-up, and the first two drills differ by what a replica does at start. With a warm spare the "
        "survivors already are the capacity the load needs; the spare costs a replica's memory and a share of the "
        "cores at steady state.\n"
        "- In the autoscaling timeline, the decision follows the step within seconds; the replica it adds "
        "serves only once started, while the step's P99 has already risen.\n"
        "- On two cores, a second replica shares the cores with the first, the proxy and the clients: "
        "compare the routers with each other, and Serve's proxy with chapter 8 alone.\n"
        "- Serve's path costs CPU per streamed message and per request, in the proxy and in the replica: runs of 64 "
        "take the messages away, and what is left beside chapter 8 alone is per request. It is of the size of this "
        "small model's own work per answer, which is why one replica keeps well under chapter 8 alone here.\n"
        "- In the simulation, past the knee (95 %) more replicas help only with a router that looks at load: "
        "`random` keeps each replica a queue of its own, while `pow2` and the token counters bring the first "
        "token's P99 down as replicas are added.",
        parameters=OWN_FILES_PARAMETERS, intro_tail=OWN_FILES_TAIL,
    ),
    "climb": notebook(
        "The climb: what each chapter bought",
        "Every chapter under the same load, beside the article's figures (its GPU, its model: compare the "
        "*ratios* to ch01, not the absolute numbers). Definitions as in `benchmarks/report/`: a chapter's QPS "
        "is taken at saturation (its best level); the closed-loop knee is the last load before P99 doubles or "
        "QPS stops growing; the open-loop knee is the last offered rate before P99 triples, the achieved rate "
        "falls below 95 % of the arrivals, or over 1 % of them fail.",
        [
            ("## The table, the same-load comparisons, the open loop and the machine's calibration",
             "chapters = sorted(set(report.ARTICLE_CHAPTERS) | {r.chapter for r in closed.values()})\n"
             "notes = report.missing_chapter_notes(chapters)\n"
             "display(Markdown(report.render_table(closed, chapters, notes, report.ceiling_line(RESULTS_DIR), open_loop,\n"
             "                                     report.calibration_report(RESULTS_DIR, closed, open_loop))))"),
            ("## The climb beside the article",
             "rows = report.build_rows(closed, chapters, notes)\n"
             'show(report.plot_climb, rows, title="The climb beside the article\'s")'),
            ("## CPU and GPU references side by side\n\nThe GPU reference is read from "
             "`benchmarks/reference/gpu/` (or `$SFS_GPU_RESULTS_DIR`).",
             'gpu_dir = Path(os.environ.get("SFS_GPU_RESULTS_DIR") or ROOT / "benchmarks/reference/gpu")\n'
             "gpu_closed = plots.load_all(gpu_dir)[0] if gpu_dir.exists() else {}\n"
             "show(plots.plot_cpu_gpu_article, closed, gpu_closed)"),
            ("## The climb on a real model\n\nThe same loads serving SmolLM2-135M-Instruct (`make climb WEIGHTS=smollm2`; "
             "`SFS_REAL_MODEL_RESULTS_DIR` plots your own): the Llama architecture, forty times the parameters.",
             "say(plots.real_model_table)\n"
             "show(plots.plot_real_model_climb)"),
            ("## Latency against load (closed loop)",
             'show(report.plot_latency_vs_load, closed, title="Latency against load")'),
            ("## The knee, from the open loop\n\nArrivals at a fixed offered rate whatever the answers: the load "
             "where latency turns from linear to avalanche (the article's section 6.2). A closed loop cannot show "
             "it: its users slow down with the server.",
             "show(lambda: report.plot_open_loop(plots.require_open_loop(open_loop)))\n"
             "show(plots.plot_knees, open_loop)"),
        ],
        "- The speed-up bars are the comparable part: the shape of the climb (which chapter buys how much) beside "
        "the article's. Absolute QPS depends on the machine; the calibration table tells a slower machine from a "
        "slower server.\n"
        "- The same-load table compares P50/P99 at equal concurrency: under concurrency the batching chapters "
        "(3-6) should answer faster than chapters 1-2; at one user, look at what the window costs.\n"
        "- In the open loop, each chapter's P99 stays nearly flat, then turns up sharply: the knee. It moves to "
        "higher offered rates chapter by chapter; past it, only queueing grows.",
    ),
}


def main(names: list[str] | None = None) -> None:
    """Write the notebooks named (all when none), without outputs."""
    unknown = sorted(set(names or ()) - set(NOTEBOOKS))
    if unknown:
        raise SystemExit(f"no such notebook: {', '.join(unknown)}; known: {', '.join(NOTEBOOKS)}")
    for name, book in NOTEBOOKS.items():
        if names and name not in names:
            continue
        nbformat.validate(book)
        nbformat.write(book, HERE / f"{name}.ipynb")
        print(f"wrote notebooks/{name}.ipynb")


if __name__ == "__main__":
    main(sys.argv[1:])
