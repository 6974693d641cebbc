"""The operator's log line for an upstream server Portico cannot connect to: the caller's 503 names no host, and a
model tried once without a fallback logs no retry, so only this line says which server, why (refused, a name that
does not resolve, a timeout, OpenSSL's reason) and, for TLS, what to do (a CA to trust, a certificate to renew, an
http:// base URL). At most once a minute per server: every request meets the same failure while it lasts."""

from __future__ import annotations

import logging
import ssl
import time

from server.providers.http_connection import TransportError

_logger = logging.getLogger("server.providers.http_upstream")  # where the operator reads the upstream's other lines

_LOG_EVERY = 60.0
# What the operator can do about a certificate OpenSSL refused, by its X509_V_ERR code (other codes: trust its CA).
_TRUST_ITS_CA = "give SSL_CERT_FILE a bundle holding its CA (a private CA's), or fix its certificate"
_ADVICE = {9: "its certificate is not valid yet (check this host's clock)", 10: "its certificate has to be renewed",
           62: "the URL's host has to be one its certificate names",
           64: "the URL's address has to be one its certificate names (or use a host name it names)"}


class ConnectFailures:
    def __init__(self) -> None:
        self._logged_at: dict[str, float] = {}  # server (scheme://authority) -> when its line was last logged

    def note(self, server: str, model_id: str, exc: TransportError) -> None:
        """`exc`: a ConnectFailed or ConnectTimeout (its cause, for TLS, OpenSSL's error)."""
        now = time.monotonic()
        if now - self._logged_at.get(server, -_LOG_EVERY) < _LOG_EVERY:
            return
        self._logged_at[server] = now
        cause = exc.__cause__
        if isinstance(cause, ssl.SSLCertVerificationError):
            _logger.error("the TLS certificate of %s (the upstream serving `%s`) is not trusted: %s; %s", server,
                          model_id, (cause.verify_message or cause.reason).rstrip("."),
                          _ADVICE.get(cause.verify_code, _TRUST_ITS_CA))
        elif isinstance(cause, ssl.SSLError):
            _logger.error("the TLS handshake with %s (the upstream serving `%s`) failed: %s; if it speaks plain HTTP, "
                          "its URL is http://", server, model_id, getattr(cause, "reason", None) or type(cause).__name__)
        else:
            _logger.error("cannot connect to %s (the upstream serving `%s`): %s; logged once a minute while it lasts",
                          server, model_id, exc)
