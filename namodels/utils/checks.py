"""Config value checks that fail early with the config key in the message."""
from __future__ import annotations

import math


def check_range(name: str, value, low=None, high=None, *, low_open: bool = False, high_open: bool = False,
                integer: bool = False, allow_none: bool = False):
    """Returns ``value`` if it lies in the interval, else raises ``ValueError`` naming the config key.

    >>> check_range("data.batch_size", 0, 1, integer=True)
    Traceback (most recent call last):
    ValueError: data.batch_size: must be >= 1, got 0
    """
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{name}: must be set")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if integer and int(value) != value:
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{name}: got NaN")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name}: must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name}: must be {'<' if high_open else '<='} {high}, got {value}")
    return int(value) if integer else value


def check_choice(name: str, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value
