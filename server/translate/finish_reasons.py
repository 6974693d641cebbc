"""A finish reason as the caller was sent it, for the request's trace span (gen_ai.response.finish_reasons): the
conventions want the provider's own values, and the caller's provider is the dialect it called."""

from __future__ import annotations

from server.domain import Dialect
from server.domain_answers import Finished
from server.translate.internal_to_anthropic import STOP_REASONS
from server.translate.internal_to_openai import FINISH_REASONS


def sent_reason(finished: Finished, caller: Dialect, upstream: Dialect | None) -> str:
    """`upstream`: the dialect of the upstream that answered (None: the embedded model). Its answer was relayed to a
    caller of the same dialect, its own reason included; any other caller got the answer rendered in its dialect."""
    if upstream is caller and finished.upstream_reason:
        return finished.upstream_reason
    return (FINISH_REASONS if caller is Dialect.OPENAI else STOP_REASONS)[finished.reason]
