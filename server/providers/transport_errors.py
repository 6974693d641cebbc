"""What a failed exchange with an upstream (server/providers/http_upstream.py) means for its caller: each transport
failure (server/providers/http_connection.py) as the PorticoError the error table answers, and whether the gateway
may try again. The two failures that are the gateway's own, not the upstream's (a link to an address it does not
fetch from, no descriptor left to connect with), are logged too, sparingly: they need an operator."""

from __future__ import annotations

import logging
import time

from server.errors import OutOfResources, PorticoError, ServiceUnavailable, UpstreamError, UpstreamTimeout
from server.providers.http_client import AddressRefused
from server.providers.http_connection import (
    ConnectFailed, ConnectionBroken, ConnectTimeout, OwnLimitReached, ReadTimeout, TooLarge, Undecodable,
)

_logger = logging.getLogger("server.providers.http_upstream")  # where these lines were always logged

_STARVED_LOG_EVERY = 10.0  # seconds between log lines while the gateway cannot open connections


class TransportErrors:
    """One per upstream: its failures' errors, and what of them it has logged."""

    def __init__(self) -> None:
        self._links_refused: set[tuple[str, str]] = set()  # (model id, address class): logged once each
        self._starved_at = -_STARVED_LOG_EVERY

    def of(self, exc: BaseException, model_id: str, *, before_answer: bool) -> PorticoError:
        """Connection failures before an answer may be retried; a read timeout is not (the upstream may still be
        working on the request, and retrying would pay for it twice)."""
        name = f"`{model_id}`"
        if isinstance(exc, ConnectTimeout):
            return UpstreamTimeout(f"Connecting to the upstream serving {name} timed out.", retry_reason="timeout")
        if isinstance(exc, ReadTimeout):
            return UpstreamTimeout(f"The upstream serving {name} did not answer in time.")
        if isinstance(exc, AddressRefused):
            if (model_id, exc.kind) not in self._links_refused:
                self._links_refused.add((model_id, exc.kind))
                _logger.warning("the upstream serving %s answered with a link to a %s address: not fetched (links are "
                                "fetched from public addresses and from the base_url's own class; logged once)",
                                name, exc.kind)
            return UpstreamError(f"The upstream's image link for {name} points at an address Portico does not fetch "
                                 "from.")
        why = f": {exc}." if str(exc) else "."  # our transport's own words: what failed, never an address
        if isinstance(exc, OwnLimitReached):
            if (now := time.monotonic()) - self._starved_at >= _STARVED_LOG_EVERY:
                self._starved_at = now
                _logger.error("cannot open a connection to the upstream serving %s: %s (this process's limit, "
                              "not the upstream's; raise `ulimit -n`)", name, exc)
            return OutOfResources(f"The gateway cannot open a connection to the upstream serving {name} now{why} "
                                  "Retry shortly.", retry_after=1.0)
        if isinstance(exc, ConnectFailed):
            # Nothing was sent: retried wherever it failed. After an answer (a link to fetch), never (`fetch`).
            if before_answer:
                return ServiceUnavailable(f"Cannot connect to the upstream serving {name}{why}", retry_reason="connect")
            return UpstreamError(f"Cannot connect to fetch a result of {name}{why}")
        if isinstance(exc, ConnectionBroken):
            # A broken connection (a disconnect, a cut or malformed answer): retried only if nothing reached the
            # caller yet (server/providers/retry.py). "broken", not "connect": the connection was made.
            return UpstreamError(f"The connection to the upstream serving {name} broke off{why}",
                                 retry_reason="broken")
        if isinstance(exc, (Undecodable, TooLarge)):  # as with invalid JSON, asking again would get the same answer
            return UpstreamError(f"The upstream serving {name} {exc}.")
        return UpstreamError(f"The request to the upstream serving {name} failed: {type(exc).__name__}.")
