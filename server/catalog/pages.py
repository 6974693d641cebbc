"""A page of a key's models, the way the Anthropic API pages them: newest first, `limit` models after `after_id`
(the previous page's last), or before `before_id` (the next page's first), of the `lifecycle` stages asked for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from server.domain_models import ModelEntry
from server.errors import InvalidRequest

DEFAULT_LIMIT = 20  # Anthropic's default and range
MOST_LIMIT = 1000
LIFECYCLE_STAGES = ("active", "deprecated", "retired")  # Anthropic's; a catalog model is always active


@dataclass(frozen=True, slots=True)
class ModelPage:
    models: tuple[ModelEntry, ...]
    has_more: bool  # more models in the direction paged: after the last, or (with before_id) before the first


def model_page(entries: Sequence[ModelEntry], *, limit: int | None, after_id: str, before_id: str,
               lifecycle: Sequence[str] = ()) -> ModelPage:
    """The page asked for, or InvalidRequest naming the parameter at fault (`limit`, `after_id`, `before_id`,
    `lifecycle`). Every model of the catalog is active: a `lifecycle` filter without `active` leaves none."""
    if unknown := [stage for stage in lifecycle if stage not in LIFECYCLE_STAGES]:
        shown = unknown[0] if len(unknown[0]) <= 40 else unknown[0][:40] + "…"
        raise InvalidRequest(f"lifecycle `{shown}` is not one of {', '.join(LIFECYCLE_STAGES)}.", param="lifecycle")
    if lifecycle and "active" not in lifecycle:
        entries = ()
    size = DEFAULT_LIMIT if limit is None else limit
    if not 1 <= size <= MOST_LIMIT:
        raise InvalidRequest(limit_refusal(size), param="limit")
    if after_id and before_id:
        raise InvalidRequest("Give after_id or before_id, not both.", param="before_id")
    ordered = sorted(entries, key=lambda entry: entry.created, reverse=True)  # stable: ties keep the catalog's order
    ids = [entry.id for entry in ordered]
    if before_id:
        end = _position(ids, before_id, "before_id")
        start = max(0, end - size)
        return ModelPage(tuple(ordered[start:end]), has_more=start > 0)
    start = _position(ids, after_id, "after_id") + 1 if after_id else 0
    return ModelPage(tuple(ordered[start:start + size]), has_more=start + size < len(ordered))


def limit_refusal(limit: object) -> str:
    """The 400's message for a `limit` out of range; Envoy's Lua filter says it too, of a whole number too large for
    the request's int32, which never reaches the server (gateway/query_ranges.py takes it there)."""
    return f"limit must be between 1 and {MOST_LIMIT}, got {limit}."


def _position(ids: list[str], model_id: str, param: str) -> int:
    # A model the key may not see is unknown here too, as everywhere else (the catalog's rule).
    if model_id not in ids:
        shown = model_id if len(model_id) <= 200 else model_id[:200] + "…"
        raise InvalidRequest(f"{param} `{shown}` is not the id of a model you can list.", param=param)
    return ids.index(model_id)
