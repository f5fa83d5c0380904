"""Placeholder: this command is not implemented yet."""

from flare.errors import UsageError


def configure(parser):
    pass


def run(args):
    raise UsageError("this command is not implemented yet")
