"""Signed, expiring image links: round trip, forgery, expiry, sweeping, and a secret shared through the data dir."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from server.config_providers import ConfigError
from server.errors import NotFound, ServiceUnavailable
from server.image_store import ImageStore
from server.domain_images import GeneratedImage, ImageFormat


@dataclass
class Clock:
    now: float = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def parts(link: str) -> tuple[str, int, str]:
    url = urlsplit(link)
    query = parse_qs(url.query)
    return url.path.rsplit("/", 1)[1], int(query["expires"][0]), query["signature"][0]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> ImageStore:
    return ImageStore(tmp_path, base_url="https://img.example/", ttl_seconds=600, clock=clock)


async def test_link_round_trip(store):
    links = await store.put([GeneratedImage(b"png-bytes", ImageFormat.PNG), GeneratedImage(b"jpg", ImageFormat.JPEG)])
    assert links[0].startswith("https://img.example/v1/images/content/") and ".png?expires=" in links[0]
    first, second = [await store.get(*parts(link)) for link in links]
    assert (first.data, first.content_type) == (b"png-bytes", "image/png")
    assert (second.data, second.content_type) == (b"jpg", "image/jpeg")


async def test_forged_or_malformed_links_are_not_found(store):
    (link,) = await store.put([GeneratedImage(b"x", ImageFormat.WEBP)])
    name, expires, signature = parts(link)
    for forged in [
        (name, expires + 3600, signature),  # a longer life
        (name, expires, "0" * 64),
        (name.replace(".webp", ".png"), expires, signature),
        ("../image-link.key", expires, signature),
        ("", 0, ""),
    ]:
        with pytest.raises(NotFound, match="not valid"):
            await store.get(*forged)


async def test_expired_links_and_sweeping(store, clock, tmp_path):
    (link,) = await store.put([GeneratedImage(b"x", ImageFormat.PNG)])
    clock.now += 601
    with pytest.raises(NotFound, match="expired"):
        await store.get(*parts(link))
    (tmp_path / "images" / "keep-me.txt").write_text("not an image")
    clock.now += 1e9  # far past every file's mtime (real time) plus the ttl
    assert store.sweep() == 1
    assert [p.name for p in (tmp_path / "images").iterdir()] == ["keep-me.txt"]


async def test_processes_sharing_a_data_dir_share_links(store, tmp_path, clock):
    (link,) = await store.put([GeneratedImage(b"shared", ImageFormat.PNG)])
    other = ImageStore(tmp_path, base_url="http://elsewhere:1", clock=clock)
    assert (await other.get(*parts(link))).data == b"shared"
    assert (tmp_path / "image-link.key").stat().st_mode & 0o777 == 0o600


async def test_a_new_data_dir_means_new_secret(store, tmp_path, clock):
    (link,) = await store.put([GeneratedImage(b"x", ImageFormat.PNG)])
    stranger = ImageStore(tmp_path / "other", base_url="http://h", clock=clock)
    with pytest.raises(NotFound):
        await stranger.get(*parts(link))


async def test_an_idle_store_deletes_expired_images_on_its_own(tmp_path, clock):
    """The sweep ran only when images were stored next: a gateway asked for no more links kept the last ones' images
    on disk for good, long after their links had expired."""
    store = ImageStore(tmp_path, base_url="http://h", ttl_seconds=600, clock=clock, sweep_seconds=0.01)
    await store.put([GeneratedImage(b"x", ImageFormat.PNG)])
    store.start()
    try:
        clock.now += 1e9  # far past the file's mtime (real time) plus the ttl
        for _ in range(200):
            if not any((tmp_path / "images").iterdir()):
                break
            await asyncio.sleep(0.01)
        assert not any((tmp_path / "images").iterdir())
    finally:
        await store.close()


async def test_a_deleted_images_directory_is_nothing_to_sweep(tmp_path, caplog):
    """`rm -rf <data_dir>/images`: the sweeper logged "image sweep failed" every minute until an image was stored."""
    store = ImageStore(tmp_path, base_url="https://img.example/", sweep_seconds=0.01)
    (tmp_path / "images").rmdir()
    store.start()
    with caplog.at_level("WARNING", logger="server.image_store"):
        await asyncio.sleep(0.1)
    await store.close()
    assert caplog.text == ""


def test_an_unreadable_signing_key_is_one_line_at_start(tmp_path):
    """A directory (or an unreadable file) where image-link.key should be stopped start-up with a traceback."""
    (tmp_path / "image-link.key").mkdir()
    with pytest.raises(ConfigError, match=r"data_dir: cannot read .*image-link.key \(Is a directory\)"):
        ImageStore(tmp_path, base_url="https://img.example/")


async def test_an_image_the_store_cannot_read_is_a_503_said_in_the_log_not_a_500(store, tmp_path, caplog):
    """A file under an image's name that cannot be read (a directory restored in its place, a file of another user
    after a restore) was a 500 with a traceback: the operator's to fix, as a store that cannot write is a 503."""
    (link,) = await store.put([GeneratedImage(b"png-bytes", ImageFormat.PNG)])
    name, expires, signature = parts(link)
    (tmp_path / "images" / name).unlink()
    (tmp_path / "images" / name).mkdir()
    with pytest.raises(ServiceUnavailable, match="could not be read") as refused:
        await store.get(name, expires, signature)
    assert refused.value.retry_after > 0
    assert "cannot read a generated image" in caplog.text and name in caplog.text
