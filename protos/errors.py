"""The error every process raises for a configuration that cannot work (a flag, a config file, a
model directory): the CLI turns it into a one-line message and exit status 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which knob to change."""
