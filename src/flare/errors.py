"""Errors a user can cause, each with the exit code the specification gives it (section 5.1)."""

from __future__ import annotations


class FlareError(Exception):
    """An error reported to the user as `error: <message>` with a fixed exit code."""

    exit_code = 1


class UsageError(FlareError):
    exit_code = 2


class FetchError(FlareError):
    exit_code = 3


class CapacityError(FlareError):
    exit_code = 4


class PreparationError(FlareError):
    exit_code = 5
