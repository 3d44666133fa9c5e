"""Exceptions raised by caddtree.

Every error that a user can cause with bad input is a :class:`CaddtreeError`, so applications (and
the CLI) can catch one type and show its message without a traceback. The subclasses also derive
from the built-in exception that fits best, so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class CaddtreeError(Exception):
    """Base class of every error caddtree raises on purpose."""


class InvalidInputError(CaddtreeError, ValueError):
    """An argument has the wrong shape, type or value."""


class CostModelError(CaddtreeError, ValueError):
    """Cost-model data cannot be fitted, or a cost-model file cannot be read."""


class CheckpointError(CaddtreeError, ValueError):
    """A model checkpoint is missing, malformed, or does not fit the target model."""


class MissingDependencyError(CaddtreeError, ImportError):
    """An optional package (model weights, benchmark data, a converter, plotting) is not installed."""
