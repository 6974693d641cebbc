"""The proxy the environment names for an upstream or a fetched link (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY,
NO_PROXY), as httpx honoured it, and why one cannot be used (refused at start-up by `portico serve`)."""

from __future__ import annotations

import re
import urllib.request
from urllib.parse import urlsplit

from server.providers.http_client import Proxy


def env_proxy(url: str) -> Proxy | None:
    """The proxy the environment names for `url` (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY), as httpx honoured
    it; looked up once per upstream (and per fetched link), never from ~/.netrc. One it cannot use is refused at
    start-up (proxy_problem), so a link fetched later through it goes directly rather than failing."""
    proxy = _named_proxy(url)
    if proxy is None or _unusable(proxy) is not None:
        return None
    return Proxy.of(proxy)


def _named_proxy(url: str) -> str | None:
    proxies = urllib.request.getproxies_environment()
    parts = urlsplit(url)
    if not proxies or urllib.request.proxy_bypass_environment(parts.hostname or "", proxies):
        return None
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if proxy and "://" not in proxy:  # `proxy.corp:3128`: an HTTP proxy, as curl, requests and httpx read it
        proxy = f"http://{proxy}"
    return proxy or None


def proxy_problem(url: str) -> str | None:
    """Why the proxy the environment names for `url` cannot be used (a SOCKS proxy, a URL that is no URL), or None:
    passed over, it left the upstream asked directly, without a word. Never quotes the proxy (it may hold a
    password)."""
    proxy = _named_proxy(url)
    return None if proxy is None else _unusable(proxy)


def _unusable(proxy: str) -> str | None:
    scheme = proxy.partition("://")[0].lower()
    if re.fullmatch(r"[a-z][a-z0-9+.-]{0,19}", scheme) and scheme not in ("http", "https"):
        return f"a {scheme}:// proxy; Portico takes an http:// or https:// one"
    try:
        Proxy.of(proxy)
    except ValueError:  # a port that is no port, a bracketed host that is no IPv6 address
        return "no proxy URL (http://host:port)"
    return None
