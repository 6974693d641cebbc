"""The model catalog: which models exist, where each is served, and which of them a key may see."""

from __future__ import annotations

from collections.abc import Iterable

from server.domain_keys import ApiKey
from server.domain_models import ModelEntry
from server.errors import ModelNotFound


class Catalog:
    def __init__(self, entries: Iterable[ModelEntry]) -> None:
        self._entries = {entry.id: entry for entry in entries}

    def visible_to(self, key: ApiKey) -> list[ModelEntry]:
        return [entry for entry in self._entries.values() if key.may_use(entry.id)]

    def resolve(self, key: ApiKey, model_id: str, endpoint: str) -> ModelEntry:
        """The model a request may use on `endpoint`, or ModelNotFound.

        A model the key was not granted is reported exactly as one that does not exist.
        """
        entry = self.find(key, model_id)
        if entry.endpoint != endpoint:
            raise ModelNotFound(
                f"The model `{model_id}` is served at {entry.endpoint}, not {endpoint}: call it through {entry.endpoint}."
            )
        return entry

    def find(self, key: ApiKey, model_id: str) -> ModelEntry:
        entry = self._entries.get(model_id)
        if entry is None or not key.may_use(model_id):
            raise ModelNotFound(f"The model `{_shorten(model_id)}` does not exist or you do not have access to it.")
        return entry

    def get(self, model_id: str) -> ModelEntry | None:
        """The entry of `model_id` whatever a key may use: a fallback serves a key granted only the model it asked."""
        return self._entries.get(model_id)

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._entries


def _shorten(text: str, limit: int = 200) -> str:
    """Echo caller input in messages, but never unbounded."""
    return text if len(text) <= limit else text[:limit] + "…"
