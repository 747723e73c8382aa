"""Chapter 8: continuous batching over a paged KV cache, token streaming, an OpenAI-compatible API.

The composition: chapter 7's production shell serves a continuous backend (chapter 4's admission, then a
sequence handed to the step thread); each step is one packed forward of chapter 5's engine over the paged pool
(chapter 4's memory, sized by its rule), its attention through the block tables (the core's ``gather``, or the
fast path's backend the rule chose, ``fast/``). Routes: chapter 7's, ``/v1/inference`` (streamed and sampled
too), ``/v1/completions``, ``/v1/models`` and ``/v1/chat/completions``; ``/ui/`` draws the steps. With
``--otlp-endpoint``, one OpenTelemetry trace per request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

from fastapi import FastAPI
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from chapters.ch03_dynamic_batching.live_view import PAGE_DIR
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch04_memory_pool.server import AdmissionOptions, PoolOptions, plan_pool
from chapters.ch05_inference_engine.engine import multiplies_in_bf16
from chapters.ch05_inference_engine.engines import build_engine
from chapters.ch05_inference_engine.server import EngineOptions, engine_for
from chapters.ch07_production.request_log import REQUEST_LOG, configure_json_logging
from chapters.ch07_production.server import ProductionOptions, serve
from chapters.ch07_production.server import build_app as build_production_app
from chapters.ch08_continuous_batching.fast.attention_choice import ATTENTION_CHOICES, choose_attention
from chapters.ch08_continuous_batching.attention_gather import GatherAttention
from chapters.ch08_continuous_batching.chat_api import ChatApi
from chapters.ch08_continuous_batching.continuous_backend import ContinuousBackend, continuous_state
from chapters.ch08_continuous_batching.continuous_metrics import ContinuousCollector
from chapters.ch08_continuous_batching.fast.cuda_graphs import GraphedModelRunner, model_runner
from chapters.ch08_continuous_batching.model_runner import PackedModel, packed_model, runs_packed_steps
from chapters.ch08_continuous_batching.openai_api import CompletionsApi
from chapters.ch08_continuous_batching.paged_cache import KV_CACHE_DTYPES, KV_CACHE_RULE, PagedKVStore, kv_cache_dtype
from chapters.ch08_continuous_batching.sampled_contract import SAMPLED_CONTRACT
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, KVPolicy, SchedulerConfig
from chapters.ch08_continuous_batching.step_thread import StepThread
from chapters.ch08_continuous_batching.fast.startup_cache import quiet_unactionable_warnings
from chapters.ch08_continuous_batching.streaming import write_sse_stream
from chapters.ch08_continuous_batching.step_tracing import TracedStepThread
from chapters.ch08_continuous_batching.tracing import TracedRequests, log_trace_ids, tracing_for
from shared.model import DecoderModel
from shared.settings import ServerSettings, parse_settings, refused_flags_exit
from shared.unwritten import or_meanwhile
from shared.weights import LoadedModel

log = logging.getLogger("chapters.ch08_continuous_batching")
STEPS_PAGE_DIR = Path(__file__).parent / "ui"  # chapter 3's live page, drawing steps instead of batches


class SchedulerOptions(BaseSettings):
    """The continuous batcher's knobs: the step's budgets, the KV policy, attention, the cache's dtype, the queue."""

    model_config = ServerSettings.model_config

    max_num_seqs: int = Field(SchedulerConfig.max_num_seqs, ge=1,
                              description="sequences running at once (rows of a decode step); also the pool rule's concurrency")
    max_num_batched_tokens: int = Field(SchedulerConfig.max_num_batched_tokens, ge=1,
                                        description="tokens one step computes: decodes + prefill chunks (>= max_num_seqs)")
    kv_policy: KVPolicy = Field(SchedulerConfig.kv_policy, description="grow: blocks as needed, preempt by recompute | reserve: prompt + max_new at admission")
    attention: ATTENTION_CHOICES = Field("auto", description="paged attention backend: auto (measured once per machine and "
                                                            "settings, then cached: fast/attention_choice.py) | gather | flex | kernel")
    remeasure_attention: bool = Field(False, description="with --attention auto: measure again even if this machine's cached "
                                                          "choice exists (under $SFS_CACHE_DIR), and replace it")
    kv_cache_dtype: KV_CACHE_DTYPES = Field("auto", description=f"dtype of the paged pool's keys and values: {KV_CACHE_RULE} | fp32 | bf16")
    prefix_caching: Literal["on", "off"] = Field(
        "on", description="on: a request reuses the cached KV blocks of a prefix already computed (full blocks, by their tokens) | off")
    max_queue: int = AdmissionOptions.model_fields["max_queue"]  # chapter 4's knob: one meaning everywhere
    served_model_name: str = Field("", description="the model's name in /v1/models and /v1/completions (empty: the weights' name)")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="decode-only steps replayed from CUDA graphs, one per bucket of rows (fast/cuda_graphs.py): "
                            "auto = on where the pool is on a GPU and attention is flex | on | off")

    @model_validator(mode="after")
    def _knobs_agree(self) -> SchedulerOptions:
        self.scheduler_config()  # SchedulerConfig checks the knobs against each other: one place
        return self

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.kv_policy)


class PagedPoolOptions(PoolOptions):
    """Chapter 4's pool knobs with this chapter's block size (RESULTS.md, "The block size"): a decode step reads every
    running sequence's blocks, and a core reads a few long runs faster than many short scattered ones; the price is
    coarser prefix sharing (whole blocks only)."""

    block_tokens: int = Field(128, ge=1, description=PoolOptions.model_fields["block_tokens"].description)


class StreamingOptions(BaseSettings):
    """How a streamed answer is written: every token as it comes, or in runs (vLLM's and SGLang's ``--stream-interval``)."""

    model_config = ServerSettings.model_config

    stream_interval: int = Field(
        1, ge=1, description="token events per write of a streamed answer after its first, which is written at once; "
                             "above 1: fewer wake-ups and writes on the event loop, text in bursts")


class TracingOptions(BaseSettings):
    """Where each request's trace goes (:mod:`~chapters.ch08_continuous_batching.tracing`), if anywhere."""

    model_config = ServerSettings.model_config

    otlp_endpoint: str = Field(
        "", description="send one OpenTelemetry trace per request over OTLP/HTTP to this collector (e.g. Jaeger's "
                        "http://127.0.0.1:4318); empty: no tracing, no OpenTelemetry SDK loaded")


class ContinuousSettings(SchedulerOptions, StreamingOptions, TracingOptions, PagedPoolOptions, EngineOptions, ProductionOptions, ServerSettings):
    """Chapter 2's knobs, chapter 4's pool size, chapter 5's engine, chapter 7's shell, the scheduler's, the stream's, tracing."""


def served_name(source: str) -> str:
    """A short model name from the loader's description: ``default:tiny-default.safetensors`` -> ``tiny-default``."""
    return Path(source.rsplit(":", 1)[-1]).stem or source


def build_backend(settings: ContinuousSettings, loaded: LoadedModel,
                  wrap_model: Callable[[PackedModel], PackedModel] | None = None) -> ContinuousBackend:
    """One model version's continuous backend: engine, paged pool, attention, scheduler, step thread.

    ``wrap_model`` wraps what the engine calls (tests hold or fail steps with it).
    """
    quiet_unactionable_warnings()  # before chapter 5's engine imports the optional libraries that log them
    step_engine = engine_for(settings, loaded)  # chapter 5: its rule's choice, or the one named
    if settings.engine == "auto" and not runs_packed_steps(step_engine):  # a GPU's rule may pick recorded or exported graphs
        log.info("engine: the rule chose %s, which cannot run a packed step; running %s eagerly (this chapter records "
                 "its own decode graphs)", step_engine.label, step_engine.precision)
        step_engine = build_engine(loaded.model, "eager", step_engine.precision)
    if isinstance(getattr(step_engine, "module", None), DecoderModel):
        loaded.model = step_engine.module  # a cast copied the weights: the version keeps one copy, the one it serves
    model = packed_model(step_engine)
    kv_dtype = kv_cache_dtype(settings.kv_cache_dtype, multiplies_in_bf16(step_engine), step_engine.dtype)
    plan = plan_pool(settings, settings.max_num_seqs, loaded.config, kv_dtype, step_engine.device)  # chapter 4's rule
    pool = KVMemoryPool(loaded.config, plan.capacity_tokens, block_tokens=settings.block_tokens, device=step_engine.device, dtype=kv_dtype)
    store = PagedKVStore(pool, prefix_caching=settings.prefix_caching == "on")
    dtype_name = str(kv_dtype).removeprefix("torch.")
    log.info(
        "paged KV pool: %d blocks of %d tokens in %s, %.1f MiB on %s (%s), policy %s, prefix caching %s",
        store.manager.total_blocks, store.block_tokens, dtype_name, pool.stats().bytes_total / 2**20, pool.device,
        plan.rule, settings.kv_policy, settings.prefix_caching,
    )
    attention = or_meanwhile(lambda: choose_attention(settings.attention, store, model, settings.max_num_seqs,
                                                        settings.remeasure_attention),
                             lambda: GatherAttention(store), "attention is gather, not warmed up")
    scheduler = ContinuousScheduler(store, settings.scheduler_config())
    model = wrap_model(model) if wrap_model else model
    runner = model_runner(settings.cuda_graphs, model, store, attention, settings.max_num_seqs)
    description = {"model": loaded.source, "kv_policy": settings.kv_policy, "prefix_caching": settings.prefix_caching, "pool_rule": plan.rule,
                   "engine": step_engine.describe(), "attention": attention.name, "kv_cache_dtype": dtype_name,
                   "cuda_graphs": isinstance(runner, GraphedModelRunner)}
    step_thread = (TracedStepThread if settings.otlp_endpoint else StepThread)(runner, scheduler, settings.stream_interval)
    return ContinuousBackend(step_thread, settings.max_queue, description)


def build_app(settings: ContinuousSettings, wrap_model: Callable[[PackedModel], PackedModel] | None = None) -> FastAPI:
    """Chapter 7's production shell around the continuous backend, plus its metrics, streaming and the OpenAI routes."""
    app = build_production_app(settings, backend_factory=partial(build_backend, wrap_model=wrap_model),
                               read_state=continuous_state, title="ch08 continuous batching", chapter="ch08",
                               stream_writer=partial(write_sse_stream, stream_interval=settings.stream_interval), contract=SAMPLED_CONTRACT,
                               read_events=lambda backend: backend.step_thread.events, pages=(STEPS_PAGE_DIR, PAGE_DIR))
    versions = app.state.registry.versions
    app.state.metrics_registry.register(ContinuousCollector(
        lambda: [(v.name, v.backend) for v in list(versions.values()) if v.backend is not None]))
    model_name = settings.served_model_name or served_name(app.state.first_source)
    for api in (CompletionsApi, ChatApi):
        api(app.state.backend, app.state.tokenizer, app.state.limits, model_name, settings.stream_interval).register(app)
    app.state.tracing = tracing_for(settings.otlp_endpoint) if settings.otlp_endpoint else None
    if app.state.tracing is not None:  # outermost: its span is current while chapter 7's shell logs the request
        app.add_middleware(TracedRequests, tracing=app.state.tracing)
        log_trace_ids(REQUEST_LOG)  # a request's log line leads to its trace
    return app


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch08_continuous_batching"
    settings = parse_settings(ContinuousSettings, argv, prog=prog)
    configure_json_logging(settings.log_level)
    with refused_flags_exit(prog):  # a flag judged against the loaded model: one line, exit 2
        app = build_app(settings)
    serve(app, settings)


if __name__ == "__main__":
    main()
