"""The operator's log line for an upstream server whose TLS fails: the caller's 503 names no host, so only this line
says which server, why (OpenSSL's reason) and what to do (a CA to trust, a certificate to renew, an http:// base URL).
At most once a minute per server: a TLS failure is its configuration, not a blip, and every request would meet it."""

from __future__ import annotations

import logging
import ssl
import time

_logger = logging.getLogger("server.providers.http_upstream")  # where the operator reads the upstream's other lines

_LOG_EVERY = 60.0
# What the operator can do about a certificate OpenSSL refused, by its X509_V_ERR code (other codes: trust its CA).
_TRUST_ITS_CA = "give SSL_CERT_FILE a bundle holding its CA (a private CA's), or fix its certificate"
_ADVICE = {9: "its certificate is not valid yet (check this host's clock)", 10: "its certificate has to be renewed",
           62: "the URL's host has to be one its certificate names",
           64: "the URL's address has to be one its certificate names (or use a host name it names)"}


class TlsFailures:
    def __init__(self) -> None:
        self._logged_at: dict[str, float] = {}  # server (scheme://authority) -> when its line was last logged

    def note(self, server: str, model_id: str, exc: ssl.SSLError) -> None:
        now = time.monotonic()
        if now - self._logged_at.get(server, -_LOG_EVERY) < _LOG_EVERY:
            return
        self._logged_at[server] = now
        if isinstance(exc, ssl.SSLCertVerificationError):
            _logger.error("the TLS certificate of %s (the upstream serving `%s`) is not trusted: %s; %s", server,
                          model_id, (exc.verify_message or exc.reason).rstrip("."),
                          _ADVICE.get(exc.verify_code, _TRUST_ITS_CA))
        else:
            _logger.error("the TLS handshake with %s (the upstream serving `%s`) failed: %s; if it speaks plain HTTP, "
                          "its URL is http://", server, model_id, getattr(exc, "reason", None) or type(exc).__name__)
