"""Argument checks for every setting hetero_comm takes (hook states, the batch controller,
the lab tools, the training configuration): each returns the value or raises ``ValueError``
naming the argument and what is allowed."""

import math
from typing import Iterable, Optional


def check_int(name: str, value, low: int, high: Optional[int] = None) -> int:
    """Return ``value`` as an int, or raise ``ValueError`` naming the allowed range."""
    allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
    return value


def check_float(name: str, value, low: float, high: float, *, low_open: bool = False) -> float:
    """Return ``value`` as a float, or raise ``ValueError`` naming the allowed range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a number in {bracket}{low}, {high}]; got {value!r}")
    return float(value)


def check_choice(name: str, value, choices: Iterable):
    """Return ``value`` if it is one of ``choices``, or raise ``ValueError`` listing them."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_optional(check, name: str, value, *args, **kwargs):
    """``None``, or ``check(name, value, *args, **kwargs)``."""
    return None if value is None else check(name, value, *args, **kwargs)
