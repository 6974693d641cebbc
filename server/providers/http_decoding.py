"""The content codings an upstream may apply although Portico asks for `accept-encoding: identity` (a proxy in front
of it that compresses whatever it is asked, say): gzip (and x-gzip) and deflate, zlib-wrapped or raw, decoded with
zlib as the body is read; any other coding (br, zstd, compress, several stacked) refused by name.

Decoding runs in the reader's task, DECODED_BYTES at a time and from at most _INPUT_STEP compressed bytes at a
time: what a compressed answer holds stays bounded by what its reader has not read yet however far the data
expands (a "zip bomb"), and a reader that stops asking stops the decoding, then the socket (PAUSE_BYTES).
"""

from __future__ import annotations

import zlib

DECODED_BYTES = 256 * 1024  # one read of a compressed answer returns at most this much
_INPUT_STEP = 64 * 1024  # compressed bytes handed to zlib at once: its copy of what it leaves stays this small
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_GZIP_MAGIC = b"\x1f\x8b"  # a gzip member's first bytes


class DecodingError(Exception):
    """The body cannot be decoded. The message completes "The upstream serving `model` ..."."""


def decoder_for(content_encoding: str) -> Decoder | None:
    """The decoder an answer's `content-encoding` value asks for; None when it names no coding but identity."""
    codings = [c for c in (part.strip().lower() for part in content_encoding.split(",")) if c and c != "identity"]
    return Decoder(", ".join(codings)) if codings else None


class Decoder:
    """One answer's body decoded as it is read: `feed` it compressed bytes whenever it is `hungry`, take `decode()`
    until it is hungry again, and call `end()` once the body's last byte was fed. A body without a byte is empty,
    whatever its coding (a 204 or HEAD answer may name one); a coding other than gzip or deflate fails at the first
    byte."""

    def __init__(self, coding: str) -> None:
        self.coding = "gzip" if coding == "x-gzip" else coding
        self._zlib = zlib.decompressobj(_GZIP_WBITS) if self.coding == "gzip" else None  # deflate: at the first byte
        self._input = memoryview(b"")  # fed, not decoded yet from `_offset` on
        self._offset = 0
        self._more = False  # the last decode stopped at DECODED_BYTES: zlib may hold more output without more input
        self._started = False  # a byte of the body was decoded
        self._failure: DecodingError | None = None

    @property
    def hungry(self) -> bool:
        return self._offset >= len(self._input) and not self._more

    def feed(self, data: bytes) -> None:
        self._input, self._offset = memoryview(data), 0

    def decode(self) -> bytes:
        """Up to DECODED_BYTES decoded from what was fed; b"" may also mean that more input is needed."""
        if self._failure is not None:
            raise self._failure
        if self.hungry:
            return b""
        try:
            return self._decode()
        except DecodingError as exc:
            self._failure = exc
            raise

    def end(self) -> None:
        """After the body's last byte was decoded: compressed data cut short is an error."""
        if self._failure is not None:
            raise self._failure
        if self._started and not self._zlib.eof:
            self._failure = DecodingError(f"sent {self.coding} data that is cut short")
            raise self._failure

    def _decode(self) -> bytes:
        piece = self._input[self._offset:self._offset + _INPUT_STEP]
        decompressor = self._zlib
        if decompressor is None:
            if self.coding != "deflate":
                name = "".join(c if c.isprintable() else "?" for c in self.coding[:40])
                raise DecodingError(f"answered with content-encoding {name}, which Portico does not decode")
            # Deflate is zlib-wrapped by its RFC (1950), raw (1951) from some servers. A zlib stream's first byte
            # names method 8 in its low 4 bits; a raw stream's holds its first block's header there (and, for a
            # stored block, zero padding), which never reads 8.
            wbits = zlib.MAX_WBITS if piece[0] & 0x0F == 8 else -zlib.MAX_WBITS
            decompressor = self._zlib = zlib.decompressobj(wbits)
        self._started = True
        try:
            out = decompressor.decompress(piece, DECODED_BYTES)
        except zlib.error as exc:
            reason = str(exc).rpartition(": ")[2]  # "Error -3 while decompressing data: invalid block type"
            raise DecodingError(f"sent {self.coding} data that does not decode ({reason})") from None
        self._offset += len(piece) - len(decompressor.unconsumed_tail)
        self._more = len(out) == DECODED_BYTES
        if decompressor.eof and decompressor.unused_data:
            rest = bytes(decompressor.unused_data) + bytes(self._input[self._offset:])
            if self.coding != "gzip" or not _GZIP_MAGIC.startswith(rest[:2]):
                raise DecodingError(f"sent bytes after the end of its {self.coding} data")
            # Another gzip member follows (RFC 1952 2.2): decoded as the rest of the same body.
            self._zlib = zlib.decompressobj(_GZIP_WBITS)
            self.feed(rest)
        return out
