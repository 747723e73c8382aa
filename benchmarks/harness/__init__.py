"""The load-test harness: start a chapter's server, drive load at it, record what it measured.

Read in this order: ``workload`` (what a request is), ``profiles`` (how hard and how long),
``server_process`` (a server as a subprocess, pinned), ``loadgen`` and ``locustfile`` (Locust,
closed and open loop), ``server_stats`` and ``resource_sampler`` (what the server and the machine
did meanwhile), ``results`` and ``summaries`` (the JSON schema of a run, and how raw request records
become a level's figures), ``environment`` and ``calibration`` (which machine, how fast), ``climb``
(one chapter, every chapter, the open loop), ``ceiling`` (the load generator's own limit).
Measuring tools built on it: ``streaming`` (a streaming client that compares servers side by side),
``tradeoffs`` (chapter 5's engine and precision table), ``gpu_climb.sh`` and ``compare_commits.sh``.
"""
