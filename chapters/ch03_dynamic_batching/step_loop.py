"""The generation loop, one step at a time: schedule, execute, update.

Every way this project generates tokens is this loop with a different scheduler:

1. **schedule**: the scheduler decides what the next model call computes (a prompt pass, one decode
   token for some rows, or nothing: the work is done) and returns it as a :class:`Step`;
2. **execute**: the step runs on the model, or on any inference engine with the same two calls
   (:class:`shared.model.StepModel`: ``prefill`` and ``decode``), and returns each row's logits;
3. **update**: the scheduler turns the logits into tokens and records them: a row that has all its
   tokens is finished, a request whose every row is finished can be answered.

Chapter 3's :class:`~chapters.ch03_dynamic_batching.batched_generation.StaticBatch` schedules at the
request level: the batch is fixed when it starts and leaves together. A step-level scheduler
(continuous batching) plugs into the same loop and changes the batch between steps instead.
vLLM's engine core has the same three parts (``schedule``, ``execute_model``, ``update_from_output``).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from shared.model import StepModel


class Step(Protocol):
    """One model call, as planned by a scheduler."""

    def execute(self, model: StepModel) -> Tensor:
        """Run on ``model``; return float32 logits (rows, vocabulary) of each row's last position."""
        ...


class Scheduler(Protocol):
    def schedule(self) -> Step | None:
        """The next step to compute, or None when there is nothing (left) to do."""
        ...

    def update(self, step: Step, logits: Tensor) -> None:
        """Take the step's logits: choose each row's next token and record it."""
        ...


def run_step(scheduler: Scheduler, model: StepModel) -> bool:
    """One turn of the loop; False when the scheduler had nothing to compute."""
    step = scheduler.schedule()
    if step is None:
        return False
    scheduler.update(step, step.execute(model))
    return True


def run_until_done(scheduler: Scheduler, model: StepModel) -> None:
    """Turn the loop until the scheduler has nothing left."""
    while run_step(scheduler, model):
        pass
