"""Stored responses of /v1/responses (``store``, OpenAI's default): GET reads one back, and
``previous_response_id`` continues its conversation. In memory, the newest ``capacity``; a
response older than that is gone (404), as after a restart."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    response: dict  # the response object as returned
    messages: list[dict]  # its conversation as chat messages: the input's, then the output's


class ResponseStore:
    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, messages: list[dict]) -> None:
        self._items[response["id"]] = StoredResponse(response, messages)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
