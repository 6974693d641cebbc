"""The verdicts the benchmark prints below its table (docs/performance.md): a target is `met` or `MISSED` only when
this run measured it under the target's own conditions; otherwise it says it was not measured."""

from __future__ import annotations

from types import SimpleNamespace

from bench import peers, run
from bench.common import Row


def _peer(name: str) -> peers.Peer:
    return peers.Peer(name, proc=None, url="http://127.0.0.1:1/v1/chat/completions", model="m")


def _peers_targets(streams: Row) -> list[str]:
    gateways = [_peer(name) for name in ("portico", "litellm", "portkey", "tensorzero")]
    by_run = {(peer.name, kind): [Row(f"{peer.name} {kind}", rps=rps, requests=1000, cpu_ms=0.5)]
              for peer, rps in zip(gateways, (2000, 50, 1000, 500)) for kind in ("JSON", "stream")}
    return peers.targets(gateways, by_run, streams)


def test_peers_fewer_open_streams_than_the_target_are_not_a_miss():
    lines = _peers_targets(Row("portico 50 open streams", requests=50, errors=0, gateway_rss_mb=145))
    line = next(line for line in lines if "open streams" in line)
    assert "MISSED" not in line and "met" not in line
    assert "50 streams" in line


def test_peers_the_target_streams_are_judged():
    lines = _peers_targets(Row("portico 5000 open streams", requests=5000, errors=0, gateway_rss_mb=590))
    assert any(line.strip().startswith("met") and "5,000 of 5,000" in line for line in lines)
    lines = _peers_targets(Row("portico 5000 open streams", requests=5000, errors=3, gateway_rss_mb=590))
    assert any(line.strip().startswith("MISSED") and "3 errors" in line for line in lines)


def _args(**overrides) -> SimpleNamespace:
    return SimpleNamespace(**{"connections": 32, "rate": 100.0, **overrides})


def test_the_litellm_ratio_is_judged_at_c32_only():
    rows = [Row("portico chat JSON", rps=2400), Row("litellm chat JSON", rps=100)]
    assert any("20x LiteLLM, chat JSON" in line for line in run.targets(rows, {}, _args()))
    assert not any("LiteLLM" in line for line in run.targets(rows, {}, _args(connections=4)))


def test_the_litellm_ratio_is_missed_when_portico_had_errors():
    rows = [Row("portico chat JSON", rps=2400, errors=7), Row("litellm chat JSON", rps=100)]
    line = next(line for line in run.targets(rows, {}, _args()) if "LiteLLM" in line)
    assert "MISSED" in line and "7 errors" in line


def test_peers_a_target_is_missed_when_portico_had_errors():
    gateways = [_peer(name) for name in ("portico", "litellm", "portkey", "tensorzero")]
    by_run = {(peer.name, kind): [Row(f"{peer.name} {kind}", rps=rps, requests=1000, cpu_ms=0.5,
                                      errors=5 if peer.name == "portico" else 0)]
              for peer, rps in zip(gateways, (2000, 50, 1000, 500)) for kind in ("JSON", "stream")}
    lines = peers.targets(gateways, by_run, None)
    for target in ("Portkey's", "0.9 ms per JSON request", "1.0 ms per streamed request"):
        line = next(line for line in lines if target in line)
        assert line.strip().startswith("MISSED") and "5 errors" in line
