"""`python -m ignition` runs the `ignition` command (the distribution's name, as the specification uses it)."""
