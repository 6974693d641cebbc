"""The `tracing:` section: OpenTelemetry traces exported over OTLP/HTTP (protobuf). Off unless `otlp_endpoint` is set.
Read by server/config.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.config_providers import ConfigError, known_settings, number, optional_mapping, url_parts
from server.limits.settings import redacted

# The exporter's thread waits with threading's timeouts and its requests with socket's: past ~1e10 s both raise
# OverflowError (the thread died, no trace left); a day is more than any batch or export needs.
MAX_EXPORT_SECONDS = 86_400
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, added to an endpoint given without a path


@dataclass(frozen=True, slots=True)
class TracingSettings:
    otlp_endpoint: str | None = None  # None: no traces (the default)
    sample_ratio: float = 1.0  # of the traces Portico starts; a caller's sampled flag is honoured either way
    # The spans' service.name; None: OTEL_SERVICE_NAME's, else OTEL_RESOURCE_ATTRIBUTES' service.name, else "portico"
    service_name: str | None = None
    max_queue_size: int = 2048  # finished spans waiting for export; spans beyond it are dropped and counted
    export_delay_seconds: float = 2.0  # a batch leaves at least this often (sooner when it is full)
    max_export_batch_size: int = 512
    export_timeout_seconds: float = 10.0  # one export, its retries included

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None


def parse_tracing(raw: Any, where: str) -> TracingSettings:
    raw = optional_mapping(raw, where)
    known_settings(raw, ("otlp_endpoint", "sample_ratio", "service_name", "max_queue_size", "export_delay_seconds",
                         "max_export_batch_size", "export_timeout_seconds"), where)
    service_name = raw.get("service_name")
    if service_name is not None and (not isinstance(service_name, str) or not service_name.strip()):
        raise ConfigError(f"{where}.service_name: a non-empty string, not {service_name!r}")
    endpoint = raw.get("otlp_endpoint")
    if endpoint is not None:
        endpoint = _endpoint(endpoint, f"{where}.otlp_endpoint")
    max_queue_size = number(raw, "max_queue_size", 2048, where, integer=True, low=1)
    settings = TracingSettings(
        otlp_endpoint=endpoint,
        sample_ratio=number(raw, "sample_ratio", 1.0, where),
        service_name=service_name,
        max_queue_size=max_queue_size,
        export_delay_seconds=number(raw, "export_delay_seconds", 2.0, where, positive=True, high=MAX_EXPORT_SECONDS),
        max_export_batch_size=number(raw, "max_export_batch_size", 512, where, integer=True, low=1,
                                     high=max_queue_size),
        export_timeout_seconds=number(raw, "export_timeout_seconds", 10.0, where, positive=True,
                                      high=MAX_EXPORT_SECONDS),
    )
    if not 0.0 <= settings.sample_ratio <= 1.0:
        raise ConfigError(f"{where}.sample_ratio: a fraction from 0 to 1, not {settings.sample_ratio}")
    return settings


def _endpoint(value: Any, where: str) -> str:
    """An http(s) URL; `/v1/traces` is added when it has no path, as OTLP exporters do with a base URL."""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: an http:// or https:// URL, e.g. http://127.0.0.1:4318")
    parts = url_parts(value)
    if not parts or parts.scheme not in ("http", "https") or not parts.hostname:
        # A collector behind basic auth may be named with its credentials: the line quotes the URL without them.
        raise ConfigError(f"{where}: an http:// or https:// URL, e.g. http://127.0.0.1:4318, not {redacted(value)!r}")
    if parts.path in ("", "/"):
        return parts._replace(path=TRACES_PATH).geturl()
    return value
