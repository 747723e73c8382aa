"""Chapter 8's server with a per-request trace of where a prompt's time to first token goes (this study only).

Run as ``python -m benchmarks.studies.ch08_shared_prefix.traced_server`` with chapter 8's flags and
``CH08_TRACE=<path>``: it wraps the scheduler's ``schedule`` and ``update`` (nothing in the chapter
changes) and appends one JSON line per request at its first token: when it arrived, when the step
that first computed it began, when its first token came, how many of its prompt's positions the
prefix cache held at admission, how many steps it took part in before its first token, and the
size of the step that gave it (decode rows, prompt tokens, seconds); and one line per request at its last
token (``"kind": "answer"``): when it arrived, was first computed, got its first token and finished, how many steps it took part
in and their seconds (all, and the longest), the prompt tokens of other requests computed in those steps,
its preemptions, its prompt's positions found cached and how many requests were running when it was admitted. ``CH08_NO_HOLD=1`` runs the
scheduler without :meth:`~chapters.ch08_continuous_batching.scheduler.ContinuousScheduler._held_for_prefixes_in_flight`
(every waiting request admitted in order, as before it), for side-by-side rounds.
"""

from __future__ import annotations

import json
import os
import time

from chapters.ch08_continuous_batching import scheduler as scheduler_module

TRACE_PATH = os.environ.get("CH08_TRACE", "")
_plain_schedule = scheduler_module.ContinuousScheduler.schedule
_plain_update = scheduler_module.ContinuousScheduler.update
_trace_file = open(TRACE_PATH, "a", buffering=1) if TRACE_PATH else None  # noqa: SIM115 (the process's life)
_seen: dict[int, dict] = {}
_done: set[int] = set()  # sequences whose first token is traced
_step_started = [0.0]
_answers: dict[int, dict] = {}  # per running sequence: what its steps cost until its last token


def _traced_schedule(self):
    _step_started[0] = time.perf_counter()
    step = _plain_schedule(self)
    if step is not None:
        for row in step.rows:
            if row.seq.seq_id in _done:
                continue
            info = _seen.setdefault(row.seq.seq_id, {"steps": 0, "prompt": len(row.seq.prompt_ids)})
            if "first_step_at" not in info:
                info.update(first_step_at=_step_started[0], cached=row.start, waiting_at_admission=len(self.waiting))
                _answers.setdefault(row.seq.seq_id, {"steps": 0, "steps_s": 0.0, "longest_step_s": 0.0,
                                                     "others_prompt_tokens": 0, "running_at_admission": len(self.running),
                                                     "cached": row.start, "first_step_at": _step_started[0]})
            info["steps"] += 1
    return step


def _traced_update(self, step, logits):
    _plain_update(self, step, logits)
    ended = time.perf_counter()
    prefill_tokens = step.num_tokens - len(step.decode_rows)
    _trace_answers(step, ended - _step_started[0], prefill_tokens)
    for row in step.rows:
        seq = row.seq
        if seq.seq_id in _done or seq.first_token_at is None or seq.seq_id not in _seen:
            continue
        info = _seen.pop(seq.seq_id)
        _done.add(seq.seq_id)
        record = {"arrived": seq.arrived, "first_step_at": info["first_step_at"], "first_token_at": seq.first_token_at,
                  "prompt": info["prompt"], "cached": info["cached"], "steps_to_first": info["steps"],
                  "waiting_at_admission": info["waiting_at_admission"], "step_decodes": len(step.decode_rows),
                  "step_prefill_tokens": prefill_tokens, "step_s": ended - _step_started[0]}
        if _trace_file is not None:
            _trace_file.write(json.dumps(record) + "\n")


def _trace_answers(step, step_s: float, prefill_tokens: int) -> None:
    """Each row's share of the step just ended; one ``answer`` line for each sequence it finished."""
    for index, row in enumerate(step.rows):  # decode rows first
        seq = row.seq
        answer = _answers.get(seq.seq_id)
        if answer is None:
            continue
        own_prompt = 0 if index < len(step.decode_rows) else row.length
        answer["steps"] += 1
        answer["steps_s"] += step_s
        answer["longest_step_s"] = max(answer["longest_step_s"], step_s)
        answer["others_prompt_tokens"] += prefill_tokens - own_prompt
        if seq.finished_at is not None:
            del _answers[seq.seq_id]
            if _trace_file is not None:
                _trace_file.write(json.dumps({"kind": "answer", "arrived": seq.arrived, "first_token_at": seq.first_token_at,
                                              "finished_at": seq.finished_at, "prompt": len(seq.prompt_ids),
                                              "generated": seq.num_generated, "preemptions": seq.preemptions, **answer}) + "\n")


if os.environ.get("CH08_NO_HOLD") == "1":  # the scheduler as it was before it held requests for a prefix in flight
    scheduler_module.ContinuousScheduler._held_for_prefixes_in_flight = lambda self: set()
scheduler_module.ContinuousScheduler.schedule = _traced_schedule
scheduler_module.ContinuousScheduler.update = _traced_update

if __name__ == "__main__":
    from chapters.ch08_continuous_batching.server import main

    main()
