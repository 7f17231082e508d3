"""Where the engine is in its step: one `Phase`, read by every unit for the errors that name
where a rank waited. Uses: nothing of the engine."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """The engine's phase (zero.py): set up, then forward / backward / between steps, in turn."""

    SET_UP = "set-up"
    FORWARD = "forward"
    BACKWARD = "backward"
    BETWEEN_STEPS = "between steps"


class Clock:
    """The engine's finished backwards and its phase; the engine alone moves it, units read it."""

    def __init__(self) -> None:
        self.steps = 0
        self.phase = Phase.SET_UP

    def enter(self, phase: Phase) -> None:
        self.phase = phase

    def step_done(self) -> None:
        self.steps += 1

    def __str__(self) -> str:
        return self.phase.value if self.phase is Phase.SET_UP else f"step {self.steps}, {self.phase.value}"
