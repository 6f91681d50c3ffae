"""The responses a gateway keeps (``store``, OpenAI's default), for ``previous_response_id``
and ``GET``/``DELETE /v1/responses/{id}``: in memory, bounded by a count
(``--responses-store-size``) and a total size (``--responses-store-max-bytes``), the least
recently used dropped first. Each gateway has its own: behind several gateways a client
continues a response through the gateway that made it (or sends the history as input).

A response is held from its start (``status: in_progress``, as OpenAI's ``GET`` shows one
that runs) and replaced by its end state when it settles; one deleted while it runs stays
deleted (its end is not stored), one that fails is dropped.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    context: list[dict[str, Any]]  # the input items the model read (history and input)
    size: int  # bytes of both as JSON, what the store's bound counts

    @property
    def history(self) -> list[dict[str, Any]]:
        """What a response continuing this one reads before its own input."""
        return self.context + list(self.response["output"])


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._running: set[str] = set()  # started, not settled, not deleted

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], context: list[dict[str, Any]]) -> bool:
        """Keeps the response; False where it alone is larger than the whole store."""
        size = len(json.dumps([response, context], separators=(",", ":")))
        if not self.enabled or size > self.max_bytes:
            return False
        self._drop(response["id"])
        self._entries[response["id"]] = StoredResponse(response, context, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size
        return True

    def start(self, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        """Holds a response that has just started, until ``settle``."""
        self._running.add(response["id"])
        self.put(response, context)

    def settle(self, response: dict[str, Any], context: list[dict[str, Any]], keep: bool) -> None:
        """A started response's end state: kept (also where the bounds had dropped it while it
        ran) unless it was deleted meanwhile, or dropped where ``keep`` is False."""
        if response["id"] not in self._running:
            return
        self._running.discard(response["id"])
        if keep:
            self.put(response, context)
        else:
            self._drop(response["id"])

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Drops a response; one running is not kept when it ends either."""
        if not self._drop(response_id):
            return False
        self._running.discard(response_id)
        return True

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
