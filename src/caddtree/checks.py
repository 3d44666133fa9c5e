"""The one home of the library's argument checks on numbers.

``True`` is an ``int`` to Python and NumPy integers are not, so "is this an integer" is easy to get
wrong in a one-line check; every module asks here instead. The error messages name the argument
and say what it must be, so a caller can fix the call without reading the code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import CaddtreeError, InvalidInputError

__all__ = ["check_int", "is_int", "is_number"]


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), and not a bool."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, np.integer))


def is_number(value: Any) -> bool:
    """A real number (Python or NumPy, integer or float), and not a bool."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(
        value, (int, float, np.integer, np.floating)
    )


def _describe(minimum: int) -> str:
    return {0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}"
    )


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int = 1,
    allow_none: bool = False,
    error: type[CaddtreeError] = InvalidInputError,
) -> int | None:
    """``value`` as an ``int`` if it is an integer of at least ``minimum`` (``None`` passes when
    ``allow_none``); otherwise ``error`` saying ``"{name} must be a positive integer, got ..."``."""
    if value is None and allow_none:
        return None
    if not is_int(value) or value < minimum:
        or_none = " or None" if allow_none else ""
        raise error(f"{name} must be {_describe(minimum)}{or_none}, got {value!r}")
    return int(value)
