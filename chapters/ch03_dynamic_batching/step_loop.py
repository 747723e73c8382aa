"""The generation loop: a scheduler plans each model call (a :class:`Step`), it runs on a StepModel, the scheduler records it."""

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
