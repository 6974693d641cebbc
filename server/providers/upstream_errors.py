"""An upstream model server's failures -> rows of Portico's one error table (server/errors.py).

A 4xx about the request is the caller's problem and keeps its meaning: never a 500. But an upstream that refuses
Portico's own credentials (401/403) or does not know the configured upstream model (404) is the gateway's
configuration: a 502 `upstream_error` that says so (and an error in the log) with `x-should-retry: false`, never a
401/404 that would make an SDK tell the user their key or model is wrong. Statuses the provider's retry settings
name, connection failures before an answer, and streams cut before any content are retryable. An upstream's own
message is passed on (and on a 400 its `code`, where it is a plain identifier: frameworks branch on OpenAI's), but
never text that could hold the upstream key (401/403 messages, which sometimes quote part of it, are replaced, and
the key is scrubbed from every other message) nor the upstream's name for the model (replaced by Portico's model id).
"""

from __future__ import annotations

import email.utils
import html
import logging
import math
import re
import time
from collections.abc import Collection, Mapping

from server import wire_json
from server.domain import Json
from server.errors import (
    ANTHROPIC_TYPES, CONTEXT_LENGTH_EXCEEDED, TABLE, InvalidRequest, NotFound, PorticoError, RateLimited,
    RequestTooLarge, ServiceUnavailable, UpstreamError, UpstreamMisconfigured, UpstreamTimeout, redact_secrets,
)

_logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 500  # an upstream's message is shown to callers, but not an HTML error page in full


class RefusalLog:
    """An upstream refusing the gateway's credentials, model, path or account, logged once when it starts (per
    upstream and status) and once when the upstream answers again: every request it refuses meanwhile is in the
    access log, and a line each would bury the one that says what to fix (operations.md, Logs)."""

    def __init__(self) -> None:
        self._refused: dict[str, dict[int, int]] = {}  # upstream -> {status: requests refused}

    def refused(self, upstream: str, status: int, line: str, *args: object) -> None:
        counts = self._refused.setdefault(upstream, {})
        if status not in counts:
            _logger.error(line, *args)
        counts[status] = counts.get(status, 0) + 1

    def answered(self, upstream: str) -> None:
        if counts := self._refused.pop(upstream, None):
            _logger.warning("The upstream serving %s answers again (%d requests refused meanwhile).", upstream,
                            sum(counts.values()))


def from_status(
    status: int, body: bytes, headers: Mapping[str, str], *, retry_on: Collection[int], upstream: str,
    secret: str | None, upstream_model: str | None = None, sent_status: bool = True,
    refusals: RefusalLog | None = None,
) -> PorticoError:
    """The error for an upstream's non-2xx answer. `upstream` names it in messages (a model id, never a URL with
    credentials); `secret` is scrubbed from anything passed on, and `upstream_model` replaced by `upstream`.
    `sent_status`: false for a status inferred from an error the upstream reported otherwise, which messages then do
    not quote (the upstream's own answer said 200). An upstream's `x-should-retry: false` (OpenAI and Anthropic send
    it) is obeyed: that deployment is not tried again for the request, and the caller is told the same."""
    error = _error_for(status, body, headers, retry_on=retry_on, upstream=upstream, secret=secret,
                       upstream_model=upstream_model, sent_status=sent_status, refusals=refusals or RefusalLog())
    if headers.get("x-should-retry", "").strip().lower() == "false":
        error.should_retry = False
    return error


def _error_for(
    status: int, body: bytes, headers: Mapping[str, str], *, retry_on: Collection[int], upstream: str,
    secret: str | None, upstream_model: str | None, sent_status: bool, refusals: RefusalLog,
) -> PorticoError:
    message, param, code, details = _error_parts(body)
    # Scrubbed whole, then cut: cut first, a key quoted across the cut would keep its first part.
    message = _scrub(message, secret, upstream_model, upstream)[:MAX_MESSAGE_CHARS] or f"HTTP {status}"
    param = _scrub(param, secret, upstream_model, upstream)[:MAX_MESSAGE_CHARS] if param else param
    if code is not None and _scrub(code, secret, upstream_model, upstream) != code:
        code = None
    details = _scrubbed_details(details, secret, upstream_model, upstream)
    reason = str(status) if status in retry_on else None
    wait = retry_after(headers)
    if status == 404 and details:  # Anthropic's 404 about what the request named (`thread_not_found`), not the model
        return NotFound(message, param=param, retry_reason=reason, details=details)
    if status in (401, 403, 404):
        what = "does not know the configured model or path" if status == 404 else "refused Portico's credentials"
        # A 404 is as often a base_url without /v1 (or with one too many) as a wrong upstream model name.
        check = "the provider's `model` and `base_url`" if status == 404 else "the gateway's configuration"
        refusals.refused(upstream, status, "The upstream serving %s %s (HTTP %d): check %s.", upstream, what, status,
                         check)
        return UpstreamMisconfigured(f"The upstream serving `{upstream}` {what} (HTTP {status}): this is the "
                                     "gateway's configuration, not your key or request.", retry_reason=reason)
    if status == 402 or status == 429 and code == _NO_QUOTA:  # Anthropic's billing_error, OpenAI's insufficient_quota
        refusals.refused(upstream, status, "The upstream serving %s refused the gateway's account (HTTP %d, %s): "
                         "check its billing.", upstream, status, code or "billing")
        quoted = f"HTTP {status}: " if sent_status else ""
        return UpstreamMisconfigured(f"The upstream serving `{upstream}` refused the gateway's account with it "
                                     f"({quoted}billing or quota): this is the gateway's account, not your key or "
                                     "request.", retry_reason=reason)
    if status == 429:
        return RateLimited(f"The upstream serving `{upstream}` is rate limiting: {message}", retry_after=wait,
                           subject=f"upstream of {upstream}", retry_reason=reason)
    if status in (408, 504):
        return UpstreamTimeout(f"The upstream serving `{upstream}` timed out: {message}", retry_reason=reason)
    if status in (503, 529):
        return ServiceUnavailable(f"The upstream serving `{upstream}` is unavailable: {message}",
                                  retry_after=wait, retry_reason=reason)
    if status >= 500:
        quoted = f" (HTTP {status})" if sent_status else ""
        return UpstreamError(f"The upstream serving `{upstream}` failed{quoted}: {message}",
                             retry_after=wait, retry_reason=reason)
    if status < 400:  # a redirect (not followed) or another answer that is no error of the caller's request
        return UpstreamMisconfigured(f"The upstream serving `{upstream}` answered HTTP {status} instead of an answer: "
                                     "check the gateway's configuration (its base_url).", retry_reason=reason)
    if status == 413:
        return RequestTooLarge(message, param=param, retry_reason=reason, details=details)
    # Other servers' words for it, or OpenAI's without its code (vLLM's `"code": 400`): the code frameworks catch.
    if _CONTEXT_ERROR.search(message) or (code is None and _OPENAI_CONTEXT_ERROR.search(message)):
        code = CONTEXT_LENGTH_EXCEEDED
    if code == CONTEXT_LENGTH_EXCEEDED:
        param = param or "messages"
    return InvalidRequest(message, param=param, retry_reason=reason, code=code, details=details)


# An upstream's own `code` that callers may read (OpenAI's `context_length_exceeded`, `content_policy_violation`,
# `unsupported_parameter`): a plain identifier, never a number ("400", vLLM's 400) nor a code of another row of the
# table, which would tell the caller something else (a 400 `model_not_found` about the upstream's model name).
_UPSTREAM_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_NO_QUOTA = "insufficient_quota"  # OpenAI's 429 code for an account out of credit: no wait mends it
_ROW_CODES = frozenset(kind.code for kind in TABLE) - {InvalidRequest.kind.code}
# OpenAI's words for a prompt over the context window ("This model's maximum context length is 8192 tokens.
# However, ..."), which vLLM sends with "code": 400.
_OPENAI_CONTEXT_ERROR = re.compile(r"maximum context length is \d+ tokens")
# Other servers' words for a prompt over the context window, whatever their code: Anthropic's 400 ("prompt is too long:
# 209353 tokens > 199999 maximum", and for a prompt and max_tokens over it together "input length and `max_tokens`
# exceed context limit: 188240 + 21333 > 200000, ..."), TGI's 422 ("Input validation error: `inputs` tokens +
# `max_new_tokens` must be <= 4096. Given: ...", or "`inputs` must have less than 4095 tokens. Given: 5000") and
# Ollama's 400 ("the prompt is longer than the context length currently available to the model; ...").
_CONTEXT_ERROR = re.compile("|".join([
    r"^prompt is too long: \d+ tokens > \d+ maximum",
    r"^input length and `max_tokens` exceed context limit: \d+ \+ \d+",
    r"^Input validation error: `inputs` (tokens \+ `max_new_tokens` must be <=|must have less than) \d+",
    r"^the prompt is longer than the context length",
]))
# llama.cpp's server's type for it ("request (9000 tokens) exceeds the available context size (8192 tokens)", with
# "code": 400), in words of its own.
_LLAMA_SERVER_CONTEXT_ERROR = "exceed_context_size_error"


# Anthropic's error `type`s (in bodies and mid-stream `error` events) -> the status Anthropic gives them.
ANTHROPIC_ERROR_STATUS = {error_type: status for status, error_type in ANTHROPIC_TYPES.items()}


def from_stream_error(
    payload: Mapping, *, retry_on: Collection[int], upstream: str, secret: str | None,
    upstream_model: str | None = None, refusals: RefusalLog | None = None,
) -> PorticoError:
    """An error reported inside an upstream's stream (OpenAI: a chunk with `error`; Anthropic: `event: error`). Its
    status is the one its `code` (vLLM's in-stream errors: `"code": 400`) or `http_status_code` (TGI's) names, else its
    Anthropic `type`'s."""
    error = payload.get("error") if isinstance(payload.get("error"), Mapping) else {}
    named = [value for value in (error.get("code"), error.get("http_status_code"))
             if type(value) is int and 400 <= value <= 599]
    status = named[0] if named else ANTHROPIC_ERROR_STATUS.get(error.get("type"), 500)
    return from_status(status, wire_json.dumps(payload), {}, retry_on=retry_on, upstream=upstream, secret=secret,
                       upstream_model=upstream_model, sent_status=False, refusals=refusals)


def retry_after(headers: Mapping[str, str]) -> float:
    """Seconds the upstream asks us to wait: retry-after-ms, else retry-after (seconds or an HTTP date); 0 if none or
    not a number, at most MAX_RETRY_AFTER."""
    if (ms := headers.get("retry-after-ms")) is not None:
        try:
            return _bounded(float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return 0.0
    try:
        return _bounded(float(value))
    except ValueError:
        pass
    try:
        return _bounded(email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return 0.0


# The longest wait an upstream's hint may ask for. It is passed on to callers, and it keeps a deployment out of
# rotation (server/providers/health.py): `inf`, or a day, would take it out for good.
MAX_RETRY_AFTER = 3600.0


def _bounded(seconds: float) -> float:
    return min(seconds, MAX_RETRY_AFTER) if seconds > 0 and math.isfinite(seconds) else 0.0


def _error_parts(body: bytes) -> tuple[str, str | None, str | None, dict | None]:
    """OpenAI {"error": {"message", "param", "code"}}, Anthropic {"type": "error", "error": {"message", "details"}},
    a top-level {"message", "param", "code"} (vLLM's older servers), FastAPI's {"detail": "..."} or its validation
    errors {"detail": [{"loc", "msg"}]}, or the text itself; whole (the body is read up to 64 KiB): from_status cuts
    them. The code only where it is a plain identifier that no other row of the table uses (_UPSTREAM_CODE); the
    details only where they name an `error_code`, which the anthropic SDK reads."""
    try:
        data = wire_json.loads(body)
    except wire_json.JSONDecodeError:
        return _page_text(body.decode("utf-8", errors="replace").strip()), None, None, None
    if not isinstance(data, dict):
        return _text(data), None, None, None
    error = data.get("error")
    if isinstance(error, dict) or isinstance(data.get("message"), str):
        found = error if isinstance(error, dict) else data
        param, code, details = found.get("param"), found.get("code"), found.get("details")
        code = code if isinstance(code, str) and _UPSTREAM_CODE.fullmatch(code) and code not in _ROW_CODES else None
        if found.get("type") == _LLAMA_SERVER_CONTEXT_ERROR:
            code = CONTEXT_LENGTH_EXCEEDED
        details = details if isinstance(details, dict) and isinstance(details.get("error_code"), str) else None
        return _text(found.get("message", "")), param if isinstance(param, str) else None, code, details
    detail = data.get("detail")
    if isinstance(detail, list) and detail and all(isinstance(item, dict) for item in detail):
        places = [_location(item.get("loc")) for item in detail]
        message = "; ".join(f"{place}: {item.get('msg', '')}" if place else str(item.get("msg", ""))
                            for place, item in zip(places, detail))
        return message, places[0] or None, None, None
    if detail is not None:
        return _text(detail), None, None, None
    return _text(error or data), None, None, None


def _scrubbed_details(details: dict | None, secret: str | None, upstream_model: str | None,
                      model_id: str) -> dict | None:
    """Anthropic's `error.details` as the caller may see them: no key (the upstream's, or one shaped like Portico's)
    and not the upstream's model name, as in messages; none at all when too long to pass on whole (a message is cut,
    but a cut object is no object)."""

    def scrubbed(value: Json) -> Json:
        if isinstance(value, str):
            return redact_secrets(_scrub(value, secret, upstream_model, model_id))
        if isinstance(value, list):
            return [scrubbed(item) for item in value]
        if isinstance(value, dict):
            return {scrubbed(name): scrubbed(item) for name, item in value.items()}
        return value

    if details is None or len(wire_json.dumps(details)) > MAX_MESSAGE_CHARS:
        return None
    return scrubbed(details)


_HTML_PAGE = re.compile(r"\s*(<!doctype html|<html)", re.IGNORECASE)
_PAGE_HEADING = re.compile(r"<(title|h1)[^>]*>(.*?)</\1\s*>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]*>")


def _page_text(text: str) -> str:
    """A proxy's or server's HTML error page by its title (or first heading): `502 Bad Gateway`, not 500 characters
    of markup, nor the footer that names the proxy and its version (`nginx/1.25.3`). Other text is kept whole."""
    if not _HTML_PAGE.match(text):
        return text
    found = _PAGE_HEADING.search(text)
    return " ".join(html.unescape(_TAG.sub(" ", found.group(2))).split()) if found else ""


def _text(value: Json) -> str:
    """A message as the caller reads it: a string as it is, anything else as the JSON it came as (not Python's repr)."""
    if value is None:  # {"error": {"message": null}}: no message, so the status stands in for one
        return ""
    return value if isinstance(value, str) else wire_json.dumps(value).decode()


def _location(loc: object) -> str:
    """A FastAPI error's `loc` (["body", "messages", 0, "content"]) as a param path ("messages[0].content")."""
    if not isinstance(loc, list):
        return ""
    path = ""
    for part in loc[1:] if loc[:1] == ["body"] else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def scrubbed_object(value: Json, upstream_model: str, model_id: str) -> Json:
    """An upstream's JSON answer (a new one) with the upstream's name for the model, wherever a string holds it,
    replaced by Portico's: nothing of the upstream's naming reaches callers."""
    if isinstance(value, str):
        return _scrub(value, None, upstream_model, model_id)
    if isinstance(value, list):
        return [scrubbed_object(item, upstream_model, model_id) for item in value]
    if isinstance(value, dict):
        return {name: scrubbed_object(item, upstream_model, model_id) for name, item in value.items()}
    return value


def _scrub(message: str, secret: str | None, upstream_model: str | None, model_id: str) -> str:
    if secret:
        message = message.replace(secret, "[redacted]")
    if upstream_model and upstream_model != model_id:
        message = _model_name(upstream_model).sub(lambda _: model_id, message)
    return message


def _model_name(name: str) -> re.Pattern[str]:
    """`name` where it stands alone: not inside a longer name (`gpt-4` in `gpt-4o-mini`) or word (`e` in `object`).
    A dot ends a name unless a name's character follows it (`gpt-3.5`). In any case: some servers (Ollama) take names
    case-insensitively and quote them in their own case."""
    return re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-]|\.[\w-])", re.IGNORECASE)
