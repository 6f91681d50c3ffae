"""The three roles a worker plays, one name each everywhere: flags, worker files, metrics labels,
logs and the ``role`` a worker reports in ``WorkerLoad``."""

from __future__ import annotations

from enum import StrEnum

from protos.errors import ConfigError

# older spellings still read: "both" (what workers reported before the role was named
# "colocated" on the wire), "worker" (the `tandem worker` command and the worker-file key)
_ALIASES = {"both": "colocated", "worker": "colocated"}


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefill and decode in one worker (`tandem worker`)

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls(_ALIASES.get(text, text))
        except ValueError:
            names = ", ".join(r.value for r in cls)
            raise ConfigError(f"worker role must be one of {names}, got {text!r}") from None
