"""An image model served by an OpenAI-compatible images API (POST {base_url}/images/generations).

The caller's request passes through whole, with the upstream's model name, except `response_format`: models
differ in what they accept there (gpt-image-1 refuses it), so the upstream answers in its own way and both ways
are read: `b64_json` items are decoded, `url` items fetched (without the upstream key, since such links often
point at another host; and only where server/providers/link_addresses.py lets a link lead). The gateway then
answers in the format the caller asked for. Bytes that are not a PNG, JPEG or WebP image, and a link whose
content-type is not an image's, are the upstream's failure (502), whatever was asked.
Once the upstream answers it has drawn and billed the images, so nothing that fails after that (an answer cut off, a
link that cannot be fetched) is retried or sent down the fallbacks: each try would draw and bill them again.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
from dataclasses import replace

from server.domain import Dialect
from server.domain_images import GeneratedImage, ImageAnswer, ImageFormat, ImageRequest
from server.domain_models import UpstreamSpec
from server.errors import PorticoError, UpstreamError
from server.providers import Capabilities
from server.providers.http_upstream import HttpUpstream
from server.translate.openai_images import image_answer

_SIGNATURES = ((b"\x89PNG", ImageFormat.PNG), (b"\xff\xd8\xff", ImageFormat.JPEG))
_LINE_BREAKS = str.maketrans("", "", "\r\n")


class OpenAIImageProvider:
    capabilities = Capabilities(dialects=frozenset({Dialect.OPENAI}))  # the caller's body is passed on whole

    def __init__(self, upstream: HttpUpstream, spec: UpstreamSpec, *, model_id: str) -> None:
        self._upstream = upstream
        self._model = spec.model
        self._model_id = model_id

    async def generate(self, request: ImageRequest) -> ImageAnswer:
        body = dict(request.source) if request.source is not None else _built(request)
        body.pop("response_format", None)
        body["model"] = self._model
        # The attempt's span is ours until the answer is read: it says what the upstream answered, or failed.
        attempt = self._upstream.attempt("images/generations", body, self._model_id)
        with attempt:
            # Billed: the upstream draws and bills the images whatever its client does (server/cutoff.py).
            try:
                answer = await self._upstream.post_json("images/generations", body, model_id=self._model_id,
                                                        billed=True, cut_retried=False, attempt=attempt)
            except PorticoError as error:
                if error.answer_unread:  # it drew and billed, how many its answer would have said: counted as asked
                    error.images_drawn = request.n
                raise
            if answer.get("error"):  # a failure reported in a 200 answer, as for chat (`"error": null` is none)
                raise self._upstream.stream_error(answer, self._model_id, self._model)
            items = answer.get("data")
            if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
                raise UpstreamError(f"The upstream serving `{self._model_id}` answered without images.")
            if attempt.recording:
                attempt.answered(image_answer(answer))
        # No more than asked: admission reserved (and a budget allows) the cost of `n` images, no more.
        try:
            images = await self._upstream.billed(asyncio.gather(*(self._image(item) for item in items[:request.n])))
        except PorticoError as error:  # drawn and billed all the same: counted, though the caller gets none
            error.images_drawn = min(len(items), request.n)
            # And not asked for again by the caller either (the SDKs retry a 502 twice by default): each retry would
            # have the upstream draw and bill them again.
            error.should_retry = False
            raise
        # gpt-image models choose the background for "auto", and say which they drew.
        background = answer.get("background")
        if background in ("transparent", "opaque"):
            images = [replace(image, transparent=background == "transparent") for image in images]
        quality, usage = answer.get("quality"), answer.get("usage")
        return ImageAnswer(tuple(images), quality=quality if isinstance(quality, str) and quality else None,
                           usage=usage if isinstance(usage, dict) else None)

    async def _image(self, item: dict) -> GeneratedImage:
        if isinstance(item.get("b64_json"), str):
            data = self._decoded(item["b64_json"], "an image that is not base64")
        elif isinstance(item.get("url"), str) and item["url"][:5].lower() == "data:":
            # A data URL holds the image itself (some servers answer so): nothing to fetch, nobody to ask again.
            media, comma, encoded = item["url"][5:].partition(",")
            if not comma or not media.lower().startswith("image/") or not media.lower().endswith(";base64"):
                raise UpstreamError(f"The upstream serving `{self._model_id}` sent a data URL that is not a base64 "
                                    "image.")
            data = self._decoded(encoded, "a data URL that is not a base64 image")
        elif isinstance(item.get("url"), str):
            data = await self._upstream.fetch(item["url"], model_id=self._model_id, media_type="image")
        else:
            raise UpstreamError(f"The upstream serving `{self._model_id}` sent an image with neither data nor link.")
        revised = item.get("revised_prompt")
        return GeneratedImage(data=data, output_format=self._format(data),
                              revised_prompt=revised if isinstance(revised, str) else None)

    def _decoded(self, encoded: str, what: str) -> bytes:
        # Line breaks as base64.encodebytes and MIME wrap it are no data: the openai SDK's users' b64decode skips
        # them, so an upstream that sends them works for them; anything else not base64 is refused.
        try:
            return base64.b64decode(encoded.translate(_LINE_BREAKS), validate=True)
        except ValueError:  # binascii.Error, and the ValueError b64decode raises for a non-ASCII character
            raise UpstreamError(f"The upstream serving `{self._model_id}` sent {what}.") from None

    def _format(self, data: bytes) -> ImageFormat:
        """What the bytes are (a model may ignore output_format), so the image is served with the right type; bytes
        that are no image Portico serves are the upstream's failure, never passed on as one."""
        for signature, found in _SIGNATURES:
            if data.startswith(signature):
                return found
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return ImageFormat.WEBP
        raise UpstreamError(f"The upstream serving `{self._model_id}` sent {_looks_like(data)} where a PNG, JPEG or "
                            "WebP image belongs.")

    async def close(self) -> None:
        await self._upstream.close()


def _built(request: ImageRequest) -> dict:
    """For an ImageRequest made without a wire request (not from the REST or gRPC API)."""
    return {"prompt": request.prompt, "n": request.n, "size": f"{request.width}x{request.height}",
            "output_format": request.output_format.value, "quality": request.quality}


def _looks_like(data: bytes) -> str:
    """What bytes that are no image seem to be, for the error message: never the bytes themselves."""
    head = data[:512].lstrip()
    if not head:
        return f"{len(data)} bytes of whitespace" if data else "no bytes"
    if head[:1] == b"<":
        return f"{len(data)} bytes of HTML or XML"
    if head[:1] in (b"{", b"["):
        return f"{len(data)} bytes of JSON"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head)  # not final: a character cut at 512 bytes is no error
    except UnicodeDecodeError:
        return f"{len(data)} bytes of unrecognised binary data"
    return f"{len(data)} bytes of text"
