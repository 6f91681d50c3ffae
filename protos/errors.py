"""The error every process raises for a configuration that cannot work (a flag, a config file, a
model directory): the CLI turns it into a one-line message and exit status 2; and the key under
which a worker names the request field an INVALID_ARGUMENT is about."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which knob to change."""


# the trailing metadata key of an INVALID_ARGUMENT that names a request field (``param`` of the
# client's 400); a multiplexed stream's error chunk carries it as ``error_param``
PARAM_METADATA_KEY = "tandem-param"
