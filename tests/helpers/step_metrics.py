"""Reading the step line's figures under a clock the test controls: the values MetricsLogger.log returns on each log
step, and a clock that stands in for time.perf_counter in the modules that time the step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class StepClock:
    """Stands in for time.perf_counter (monkeypatch a module's `time` with SimpleNamespace(perf_counter=clock)):
    time moves only when the test moves it (`clock.now += seconds`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def logged_metrics(trainer: Trainer) -> list[dict[str, float]]:
    """The values MetricsLogger.log returns on each log step: the numbers the step line and TensorBoard show."""
    records: list[dict[str, float]] = []
    log = trainer.metrics.log

    def recording(*args: Any, **kwargs: Any) -> dict[str, float]:
        records.append(log(*args, **kwargs))
        return records[-1]

    trainer.metrics.log = recording  # type: ignore[method-assign]
    return records


class TimedStep:
    """Stands in for the Trainer's step object (trainer.train_step = TimedStep(trainer.train_step, clock, seconds)):
    each step call first moves the clock by seconds(step number); everything else is the step's own."""

    def __init__(self, step: Any, clock: StepClock, seconds: Any) -> None:
        self.step, self.clock, self.seconds = step, clock, seconds

    def __call__(self, n: int) -> Any:
        self.clock.now += self.seconds(n)
        return self.step(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)


class SlowData:
    """Stands in for the step's data loader (trainer.train_step.dataloader = SlowData(...)): each batch takes
    `seconds` by the clock (what the step waits for data)."""

    def __init__(self, loader: Any, clock: StepClock, seconds: float) -> None:
        self.loader, self.clock, self.seconds = loader, clock, seconds

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        self.clock.now += self.seconds
        return next(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
