"""The model's recommended sampling defaults, as vLLM's ``--generation-config`` reads them.

``auto`` (the default): the model directory's ``generation_config.json``; ``vllm``: none (the
neutral defaults); a directory: its ``generation_config.json``. ``--override-generation-config``
(a JSON object) overrides or adds keys. Of the file, only the sampling keys count (temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the default max_tokens); a
request field the client sends wins over them.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from protos.errors import ConfigError

log = logging.getLogger(__name__)

FILE = "generation_config.json"
MODES = ("auto", "vllm")
FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty")
INT_KEYS = ("top_k", "max_new_tokens")
KEYS = (*FLOAT_KEYS, *INT_KEYS)

Defaults = dict[str, float | int]


def parse_override(text: str | None) -> Defaults:
    """``--override-generation-config``: a JSON object of the sampling keys."""
    if text is None or text == "":
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            "--override-generation-config takes a JSON object such as "
            f"'{{\"temperature\": 0.5}}', got {text!r} ({e.msg})"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"--override-generation-config takes a JSON object, got {type(value).__name__}"
        )
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ConfigError(
            f"--override-generation-config: unknown key(s) {', '.join(unknown)} "
            f"(known: {', '.join(KEYS)})"
        )
    return _checked(value, "--override-generation-config")


def _checked(values: dict[str, Any], source: str) -> Defaults:
    """The sampling keys of ``values`` with a value (null: not set), each of the right type."""
    out: Defaults = {}
    for key in KEYS:
        value = values.get(key)
        if value is None:
            continue
        if key in INT_KEYS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
            if key == "max_new_tokens" and value < 1:
                raise ConfigError(f"{source}: max_new_tokens must be at least 1, got {value}")
            if key == "top_k" and value < -1:
                raise ConfigError(f"{source}: top_k must be -1, 0 or positive, got {value}")
        elif (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ConfigError(f"{source}: {key} must be a finite number, got {value!r}")
        elif key == "temperature" and not 0 <= value <= 2:
            raise ConfigError(f"{source}: temperature must be in [0, 2], got {value}")
        out[key] = value
    return out


def read_file(directory: str) -> Defaults:
    """The sampling keys of ``directory``'s generation_config.json (none where it has none)."""
    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return _checked(values, path)


def load(mode: str, model_dir: str | None, override: str | None) -> Defaults:
    """The defaults in use: ``mode`` is ``--generation-config`` (auto, vllm or a directory),
    ``model_dir`` the model's files (None: no directory to read), ``override`` the JSON of
    ``--override-generation-config``. Logged, as vLLM does, when there are any."""
    extra = parse_override(override)
    if mode == "vllm":
        found: Defaults = {}
    elif mode == "auto":
        found = read_file(model_dir) if model_dir else {}
    elif os.path.isdir(mode):
        found = read_file(mode)
    else:
        raise ConfigError(
            f"--generation-config takes auto, vllm or a directory holding {FILE}, got {mode!r}"
        )
    defaults = {**found, **extra}
    if defaults:
        source = "model" if mode == "auto" else mode
        log.warning(
            "default sampling parameters come from the %s generation config (%s): %s; a request "
            "field overrides each. To serve vLLM's neutral defaults instead, start with "
            "--generation-config vllm",
            source,
            "with --override-generation-config" if extra else FILE,
            json.dumps(defaults, sort_keys=True),
        )
    return defaults
