"""Flare: prepare a model once into a signed runtime package, then serve it fast."""

__version__ = "0.1.0"
