"""The chapter notebooks' figures: each plot reads results (never measures) and returns a matplotlib Figure.

A plot whose data the results do not hold (a schema-1 file has no stage timings, batch sizes or
series; a directory may hold no open-loop sweep) raises :class:`MissingData`, whose message names the
command that produces the data; :func:`show` turns that into a note in the notebook instead of an
empty figure, and refuses to display a figure with an empty panel (the notebooks' test relies on it).

Figures are :class:`matplotlib.figure.Figure` objects (no pyplot state), as in :mod:`benchmarks.report`.

A notebook reads them as ``plots.<name>`` (``from benchmarks.report import notebook_plots as plots``);
they live in one module per chapter (or group of chapters), and in ``common`` what they share.
"""

from __future__ import annotations

from benchmarks.report.notebook_plots.ch01_to_ch03 import (
    CH03_DEFAULT_PREFILL,
    expected_padding,
    plot_batch_sizes,
    plot_client_vs_server,
    plot_latency_and_qps,
    plot_padding,
    plot_queue_nobody_shows,
    plot_stage_breakdown,
    plot_window_tradeoff,
    prefill_mode,
    window_cost,
)
from benchmarks.report.notebook_plots.ch04_to_ch06 import (
    POOL_SERIES,
    load_tradeoffs,
    load_tuned,
    long_workload_ratios,
    plot_long_workload,
    plot_one_user_latency,
    plot_pool_over_time,
    plot_rejections,
    plot_step_time,
    plot_tradeoffs,
    plot_tuner_heatmap,
)
from benchmarks.report.notebook_plots.ch07_production import (
    DRAIN_FILE,
    DRAIN_OUTCOMES,
    LEAK_FIGURES,
    LEAK_LESSONS,
    PRODUCTION_DIR,
    drain_command,
    leak_command,
    load_drain_timeline,
    load_leak_curves,
    plot_drain_timeline,
    plot_leak_curves,
)
from benchmarks.report.notebook_plots.ch08_continuous_batching import (
    STEP_CLIMB_DIR,
    STEP_PHASES,
    STREAMING_DIR,
    STREAMING_LATENCIES,
    STREAMING_WORKLOADS,
    load_prefix_caching,
    load_step_records,
    load_streaming,
    plot_prefix_caching,
    plot_step_split,
    plot_streaming_latencies,
    plot_streaming_throughput,
    streaming_command,
)
from benchmarks.report.notebook_plots.ch09_scale_out import (
    DRILL_OUTCOMES,
    SCALE_OUT_DIR,
    load_scale_out,
    plot_autoscale_timeline,
    plot_failure_drill,
    plot_replicas_and_routers,
    plot_serve_path_costs,
    plot_simulated_scaling,
)
from benchmarks.report.notebook_plots.climb import (
    plot_cpu_gpu_article,
    plot_knees,
    plot_real_model_climb,
    plot_real_model_step,
    real_model_table,
    require_open_loop,
)
from benchmarks.report.notebook_plots.common import (
    CLOSED_COMMAND,
    LONG_COMMAND,
    MissingData,
    OPEN_COMMAND,
    article_line,
    check_figure,
    empty_panels,
    figure_titles,
    levels_of,
    levels_with_stages,
    load_all,
    load_real_model,
    real_model_dir,
    repo_relative,
    require_present,
    require_results,
    results_dir,
    say,
    show,
    shown_path,
    speedups_over_baseline,
    users_axis,
)

