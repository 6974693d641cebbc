"""Generated images kept on disk and handed out as signed, expiring links (the `url` response format).

Files live in `<data_dir>/images`, and the signing secret in `<data_dir>/image-link.key`, so every server process
sharing a data dir can serve every link. A link is
`<public base URL>/v1/images/content/<name>?expires=<unix time>&signature=<hex HMAC-SHA256(name, expires)>`:
like OpenAI's image URLs it needs no API key, and it stops working after an hour. Every server process sweeps the
expired files from disk once a minute, so none outlives its link by much, also when no more images are asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from server.config_providers import ConfigError
from server.data_dir import DataDir
from server.errors import NotFound, ServiceUnavailable
from server.private_files import make_data_dir
from server.domain_images import GeneratedImage, ImageFormat

CONTENT_PATH = "/v1/images/content/"
LINK_TTL_SECONDS = 3600  # OpenAI's image URLs also last an hour
_SWEEP_EVERY_SECONDS = 60.0
_STORE_RETRY_SECONDS = 5.0
_logger = logging.getLogger(__name__)
_NAME = re.compile(r"[A-Za-z0-9_-]{24}\.(png|jpeg|webp)")  # also keeps names inside the directory


@dataclass(frozen=True, slots=True)
class StoredImage:
    data: bytes
    content_type: str
    expires_in: int  # seconds until its link expires


class ImageStore:
    def __init__(
        self,
        data_dir: Path,
        *,
        base_url: str,
        ttl_seconds: float = LINK_TTL_SECONDS,
        clock: Callable[[], float] = time.time,
        sweep_seconds: float = _SWEEP_EVERY_SECONDS,
    ) -> None:
        files = DataDir(data_dir)
        self._dir = files.images
        make_data_dir(self._dir)
        self._secret = _load_or_create_secret(files.image_link_key)
        self._base_url = base_url.rstrip("/")
        self._ttl = ttl_seconds
        self._clock = clock
        self._sweep_seconds = sweep_seconds
        self._sweeper: asyncio.Task | None = None
        # Images cannot be stored (a full or read-only disk): logged once when it starts and once when it ends, not
        # once a request (an image client retrying filled the log).
        self._failing = False

    def start(self) -> None:
        """Sweep expired images every `sweep_seconds` until `close()`."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="image-sweeper")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def put(self, images: Sequence[GeneratedImage]) -> list[str]:
        """Store the images; return one signed link per image, in order."""
        return await asyncio.to_thread(self._put, images)

    async def get(self, name: str, expires: int, signature: str) -> StoredImage:
        """The image behind a link, or NotFound when the link is malformed, forged, expired or swept."""
        return await asyncio.to_thread(self._get, name, expires, signature)

    def link(self, name: str, expires: int) -> str:
        return f"{self._base_url}{CONTENT_PATH}{name}?expires={expires}&signature={self._sign(name, expires)}"

    def sweep(self) -> int:
        """Delete images whose links have expired; return how many. Safe to run from several processes."""
        cutoff = self._clock() - self._ttl - _SWEEP_EVERY_SECONDS  # a margin for clock skew between processes
        removed = 0
        try:
            paths = list(self._dir.iterdir())
        except FileNotFoundError:
            return 0  # deleted by hand: the next stored image makes it again
        for path in paths:
            try:
                if _NAME.fullmatch(path.name) and path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass  # another process swept it first
        return removed

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_seconds)
            try:
                await asyncio.to_thread(self.sweep)
            except OSError as exc:  # the directory removed or unreadable: say so, and try again next time
                _logger.warning("image sweep failed (%s: %s)", type(exc).__name__, exc)

    def _put(self, images: Sequence[GeneratedImage]) -> list[str]:
        expires = int(self._clock() + self._ttl)
        links, written = [], []
        try:
            self._dir.mkdir(exist_ok=True)  # deleted under a running process: made again
            for image in images:
                name = f"{secrets.token_urlsafe(18)}.{image.output_format.value}"
                written.append(path := self._dir / name)
                path.write_bytes(image.data)
                links.append(self.link(name, expires))
        except OSError as exc:  # a full disk, a read-only or missing data dir: the operator's to fix
            if not self._failing:
                self._failing = True
                _logger.error("cannot store generated images in %s (%s); said again once they are stored",
                              self._dir, exc.strerror or exc)
            for path in written:  # no link names them
                with contextlib.suppress(OSError):
                    path.unlink()
            error = ServiceUnavailable("The generated image could not be stored for its link; retry shortly, or ask "
                                       "for response_format b64_json.", retry_after=_STORE_RETRY_SECONDS)
            error.should_retry = False  # drawn and counted: an SDK's own retries would draw, bill and fail again
            raise error from None
        if self._failing:
            self._failing = False
            _logger.warning("generated images are stored in %s again", self._dir)
        return links

    def _get(self, name: str, expires: int, signature: str) -> StoredImage:
        match = _NAME.fullmatch(name)
        # As bytes: compare_digest refuses str with a non-ASCII character (TypeError, a 500) instead of answering.
        if match is None or not hmac.compare_digest(self._sign(name, expires).encode(), signature.encode()):
            raise NotFound("This image link is not valid.")
        if expires < self._clock():
            raise NotFound("This image link has expired.")
        try:
            data = (self._dir / name).read_bytes()
        except FileNotFoundError:
            raise NotFound("This image link has expired.") from None
        except OSError as exc:  # a directory or another user's file in its place (a restore): the operator's to fix
            _logger.error("cannot read a generated image %s (%s)", self._dir / name, exc.strerror or exc)
            raise ServiceUnavailable("The image could not be read; retry shortly.",
                                     retry_after=_STORE_RETRY_SECONDS) from None
        return StoredImage(data=data, content_type=ImageFormat(match.group(1)).content_type,
                           expires_in=max(0, int(expires - self._clock())))

    def _sign(self, name: str, expires: int) -> str:
        return hmac.new(self._secret, f"{name}\n{expires}".encode(), hashlib.sha256).hexdigest()


def _load_or_create_secret(path: Path) -> bytes:
    """Read the shared signing secret, creating it on first use.

    Several processes may start at once: the secret is written to a private temporary file and linked into place,
    which either succeeds whole or finds another process's complete file, so nobody reads a half-written key.
    """
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(secrets.token_bytes(32))
            try:
                os.link(temporary, path)
            except FileExistsError:
                pass  # another process won the race; use its secret
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as exc:  # a full or read-only data dir: one line at start, not a traceback
        raise ConfigError(f"data_dir: cannot create {path} ({exc.strerror or exc})") from None
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    try:
        secret = path.read_bytes()
    except (IsADirectoryError, PermissionError) as exc:  # one line at start, not a traceback
        raise ConfigError(f"data_dir: cannot read {path} ({exc.strerror})") from None
    if len(secret) < 32:
        raise ConfigError(f"data_dir: {path} is damaged (shorter than 32 bytes); delete it to make a new one")
    return secret
