"""Image links (`response_format: url`) as a browser or an HTTP client meets them through the real gateway."""

from __future__ import annotations

import re

import httpx
import openai

from server.image_store import LINK_TTL_SECONDS


def test_a_link_may_be_kept_by_the_callers_cache_until_it_expires(oai: openai.OpenAI):
    """The bytes behind a link never change: a page that shows the image again need not fetch it again, but no
    cache may keep it past the link's hour, nor share it (the link is its only credential)."""
    url = oai.images.generate(model="family-a-image-2", prompt="a lighthouse", size="256x256",
                              response_format="url").data[0].url
    for answer in (httpx.get(url), httpx.head(url)):
        assert answer.status_code == 200 and answer.headers["content-type"] == "image/png"
        cache = answer.headers.get("cache-control", "")
        assert re.fullmatch(r"private, max-age=\d+, immutable", cache), cache
        assert LINK_TTL_SECONDS - 60 <= int(cache.split("max-age=")[1].split(",")[0]) <= LINK_TTL_SECONDS
    refused = httpx.get(url[:-4] + "0000")  # its signature changed
    assert refused.status_code == 404 and "max-age" not in refused.headers.get("cache-control", "")
