"""Typed, bounded reads of JSON fields; every wrong value becomes a 400 naming the field."""

from __future__ import annotations

import math
from typing import Any

from gateway.core.errors import APIError, invalid

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class Fields:
    """A request body (a JSON object). ``null`` reads as "not given". Every name read is kept in
    :attr:`read`, so that what no parser looked at can be refused (``refuse_unknown``)."""

    def __init__(self, body: dict[str, Any], read: set[str] | None = None) -> None:
        self.body = body
        self.read: set[str] = set() if read is None else read

    def updated(self, **values: Any) -> Fields:
        """The body with ``values`` put in, sharing what was read so far."""
        return Fields({**self.body, **values}, self.read)

    def get(self, name: str) -> Any:
        self.read.add(name)
        return self.body.get(name)

    def get_int(
        self, name: str, default: int | None, lo: int = -INT64_MAX, hi: int = INT64_MAX
    ) -> int | None:
        value = self.get(name)
        if value is None:
            return default
        return check_int(value, name, lo, hi)

    def get_float(self, name: str, default: float, lo: float, hi: float) -> float:
        value = self.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(f"{name} must be a number, got {kind_of(value)}", name)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise invalid(f"{name} must be between {lo} and {hi}, got {value}", name)
        return float(value)

    def get_bool(self, name: str, default: bool) -> bool:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"{name} must be true or false, got {kind_of(value)}", name)
        return value

    def get_str(self, name: str, default: str | None, max_len: int = 256) -> str | None:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise invalid(f"{name} must be a string, got {kind_of(value)}", name)
        if len(value) > max_len:
            raise invalid(f"{name} must be at most {max_len} characters", name)
        return value

    def get_dict(self, name: str) -> dict[str, Any]:
        value = self.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise invalid(f"{name} must be an object, got {kind_of(value)}", name)
        return value

    def str_list(self, name: str, max_items: int, max_len: int) -> tuple[str, ...]:
        """A string or a list of strings (``stop``)."""
        value = self.get(name)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise invalid(f"{name} must be a string or a list of strings", name)
        if len(items) > max_items:
            raise invalid(f"{name} may hold at most {max_items} entries, got {len(items)}", name)
        if any(len(s) > max_len for s in items):
            raise invalid(f"each entry of {name} must be at most {max_len} characters", name)
        return tuple(items)

    def int_list(self, name: str, max_items: int) -> tuple[int, ...]:
        value = self.get(name)
        if value is None:
            return ()
        if not isinstance(value, list):
            raise invalid(f"{name} must be a list of integers, got {kind_of(value)}", name)
        if len(value) > max_items:
            raise invalid(f"{name} may hold at most {max_items} entries, got {len(value)}", name)
        return tuple(check_int(v, name, 0, INT32_MAX) for v in value)


def check_keys(obj: dict[str, Any], allowed: tuple[str, ...], where: str, param: str) -> None:
    """A 400 for a key of a nested object (a tool, a response format) that it does not have:
    a misspelt one (``paramters``) must not quietly drop what it carried."""
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise invalid(
            f"Unrecognized field: {where}.{unknown[0]} ({where} takes {', '.join(allowed)}; "
            "drop it)",
            param,
        )


def check_int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {kind_of(value)}", name)
    if not lo <= value <= hi:
        raise invalid(f"{name} must be between {lo} and {hi}, got {value}", name)
    return value


def kind_of(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {kind_of(body)}")
    return body
