"""Anthropic's paging of the model list: newest first, limit, after_id, before_id, and the errors naming each."""

from __future__ import annotations

import pytest

from server.catalog.pages import model_page
from server.domain import Endpoint
from server.domain_models import Deployment, ModelEntry, ProviderSpec
from server.errors import InvalidRequest


def entry(model_id: str, created: int) -> ModelEntry:
    return ModelEntry(id=model_id, endpoint=Endpoint.CHAT, owned_by="x", created=created,
                      deployments=(Deployment(name=model_id, provider=ProviderSpec(kind="llamacpp")),))


# Catalog order; newest first is c, then a and d (a tie, kept in catalog order), then b.
ENTRIES = [entry("a", 20), entry("b", 10), entry("c", 30), entry("d", 20)]


@pytest.mark.parametrize("limit, after_id, before_id, ids, has_more", [
    (None, "", "", ["c", "a", "d", "b"], False),
    (2, "", "", ["c", "a"], True),
    (2, "a", "", ["d", "b"], False),
    (1, "a", "", ["d"], True),
    (2, "b", "", [], False),
    (2, "", "b", ["a", "d"], True),
    (5, "", "d", ["c", "a"], False),
    (2, "", "c", [], False),
])
def test_pages(limit, after_id, before_id, ids, has_more):
    page = model_page(ENTRIES, limit=limit, after_id=after_id, before_id=before_id)
    assert ([m.id for m in page.models], page.has_more) == (ids, has_more)


@pytest.mark.parametrize("limit, after_id, before_id, param", [
    (0, "", "", "limit"), (1001, "", "", "limit"), (-1, "", "", "limit"),
    (None, "z", "", "after_id"), (None, "", "z", "before_id"), (None, "a", "b", "before_id"),
])
def test_errors_name_the_parameter(limit, after_id, before_id, param):
    with pytest.raises(InvalidRequest) as caught:
        model_page(ENTRIES, limit=limit, after_id=after_id, before_id=before_id)
    assert caught.value.param == param
