"""Chapter 7 as a real process: SIGTERM under load, and the deployment files that go with it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from benchmarks.harness.server_process import REPO_ROOT, free_port
from chapters.ch07_production.metrics import STAGES
from chapters.ch07_production.server import ProductionSettings

DEPLOY = Path(__file__).resolve().parent.parent / "chapters" / "ch07_production" / "deploy"


def test_k8s_probes_and_grace_period_match_the_server() -> None:
    documents = list(yaml.safe_load_all((DEPLOY / "k8s.yaml").read_text()))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    command = container["command"]
    drain_s = float(command[command.index("--drain-timeout-s") + 1]) if "--drain-timeout-s" in command \
        else ProductionSettings.model_fields["drain_timeout_s"].default
    pre_stop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s, "the kubelet would SIGKILL a drain in progress"


def test_the_dashboard_queries_only_series_the_server_exports() -> None:
    exported = {"inference_request_latency_seconds", "inference_request_total", "inference_errors_total",
                "inference_stage_latency_seconds", "inference_tokens_generated_total", "inference_prompt_tokens_total",
                "inference_queue_length", "inference_model_in_flight", "inference_model_info", "inference_kv_pool_bytes",
                "inference_kv_pool_slot_bytes_total", "inference_batch_size", "inference_device_memory_bytes", "inference_ready"}
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = {m for e in expressions for m in re.findall(r"\b(inference_[a-z_]+)", e)}
    assert named, "no query found"
    for name in named:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert base in exported, f"the dashboard queries {name}, which the server does not export"
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["metrics_path"] == "/metrics"
    assert "postprocess" in STAGES


@pytest.mark.slow
def test_sigterm_under_load_answers_every_accepted_request_and_exits_within_the_drain_timeout() -> None:
    port, drain_s = free_port(), 20
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "chapters.ch07_production", "--port", str(port), "--engine", "eager", "--precision", "fp32",
         "--drain-timeout-s", str(drain_s), "--tuned-config", "none", "--fallback-slots", "0"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)  # polling another process: no event to await
        else:
            raise AssertionError("the server never became ready")
        statuses: list[int | str] = []
        signalled = threading.Event()

        def client() -> None:
            while True:
                try:
                    answer = requests.post(f"{url}/v1/inference", json={"input_ids": [1, 2, 3], "max_new_tokens": 24}, timeout=60)
                    statuses.append(answer.status_code)
                    if answer.status_code == 503:
                        assert answer.headers.get("Retry-After")
                        return
                except requests.ConnectionError:
                    statuses.append("refused" if signalled.is_set() else "error")
                    return

        clients = [threading.Thread(target=client) for _ in range(4)]
        for thread in clients:
            thread.start()
        while len(statuses) < 8:
            time.sleep(0.05)
        signalled.set()
        sent_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=drain_s + 15)
        exit_after = time.monotonic() - sent_at
        for thread in clients:
            thread.join(timeout=30)
        log = process.stdout.read()
        assert exit_after < drain_s + 10, log[-2000:]
        assert process.returncode == 0, log[-2000:]
        assert "error" not in statuses and set(statuses) <= {200, 503, "refused"}, statuses
        assert 503 in statuses or "refused" in statuses
        assert "every accepted request was answered" in log, log[-2000:]
        assert "later garbage collections skip them" in log, "the start-up heap was not frozen before serving"
    finally:
        if process.poll() is None:
            process.kill()
