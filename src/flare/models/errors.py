"""Errors a checkpoint can cause: a configuration we cannot run, or weights that do not fit the model."""

from __future__ import annotations

from flare.errors import PreparationError, UsageError


class UnsupportedModel(UsageError):
    """The checkpoint's config.json asks for something these models do not implement."""


class WeightError(PreparationError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape."""
