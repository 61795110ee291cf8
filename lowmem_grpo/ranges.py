"""Allowed ranges of numeric settings, and the one copy of the rules the fused loss ops check.

The ops in kernels/ check their hyper-parameters when they are called (epsilon, beta, temperature);
lowmem_grpo/config/ checks the same settings when a recipe is loaded, so a bad value stops the run before any
model loads. Both read the rule from here, so the two checks cannot drift apart. This module is pure
Python and imports nothing of the package: the package's lowest layer, below kernels and config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Interval:
    """The numbers from `low` to `high` (None: unbounded); `*_open` leaves that end out. NaN is never in
    an interval, and infinities only where `finite` is False."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = True

    def __contains__(self, value) -> bool:
        value = float(value)
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        low, high = _text(self.low), _text(self.high)
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {high}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"

    def problem(self, value, name: str) -> Optional[str]:
        """None if `value` lies inside, else the sentence saying it does not."""
        if value in self:
            return None
        finite = "a finite number " if self.finite and math.isinf(float(value)) else ""
        return f"{name} must be {finite}{self}, got {value}"

    def check(self, value, name: str) -> float:
        """`value` as a float, or ValueError naming `name` and the range."""
        problem = self.problem(value, name)
        if problem:
            raise ValueError(problem)
        return float(value)


def _text(bound: Optional[float]) -> str:
    """A bound as written: 0, 1, 4294967295, 0.5 (not 0.0 or 4.29497e+09)."""
    return str(int(bound)) if bound is not None and float(bound).is_integer() else f"{bound}"


POSITIVE = Interval(0, low_open=True)
NON_NEGATIVE = Interval(0)
PROBABILITY = Interval(0, 1)

# The fused GRPO loss's hyper-parameters (kernels/grpo_loss.py: check_grpo_hparams, kernels/_checks.py:
# check_temperature). The ratio is clipped to [1 - epsilon_low, 1 + epsilon_high], so epsilon_low < 1
# keeps the lower bound above 0; epsilon_high may be inf (no upper clip).
EPSILON_LOW = Interval(0, 1, high_open=True)
EPSILON_HIGH = Interval(0, finite=False)
BETA = NON_NEGATIVE
DELTA = POSITIVE  # the two-sided clip's upper bound on the ratio (INTELLECT-2)
SAPO_TEMPERATURE = POSITIVE
TEMPERATURE = POSITIVE
