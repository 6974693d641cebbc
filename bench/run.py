"""Portico's benchmark: one command, everything on 127.0.0.1, everything it starts stopped at the end.

    make bench                                   # = .venv/bin/python -m bench
    .venv/bin/python -m bench --workers 2 --duration 10 --streams 1000
    .venv/bin/python -m bench --litellm          # the same load against LiteLLM too, after Portico's runs

It installs `wrk` (Debian) when missing, starts the mock upstream (bench/mock_upstream.py) and `portico serve` with
a generated configuration pointing family-a-5.5 (chat), family-b-sonnet-4-6 (messages) and family-a-5.4 (a slow
stream, for the open-streams run) at the mock, limits enabled (in-process, or a private redis-server with
--workers > 1) and a key checked on every request. Then:

1. wrk -t1 -c32 for --duration s each against the mock directly (the limit), Portico JSON chat completions, Portico
   streamed chat completions and Portico /v1/messages;
2. a paced run at --rate req/s to the mock and to Portico in turn (bench/client.py), for the added latency;
3. --streams streams held open at once (20 chunks 0.25 s apart), for the gateway's memory under many streams;
4. with --floor N,M,...: the JSON load against the same front door (Envoy, grpc.aio, the interceptor) with a
   handler that only uses N µs of CPU (bench/floor.py): the req/s left for a handler of that cost; `upstream` in
   the list: a handler that only forwards each request to the mock and its answer back (the design's own floor),
   for JSON and streamed requests.

With --litellm, Portico is then stopped and the LiteLLM proxy (`litellm[proxy]`, pinned in bench/litellm.py, in
its own venv under .cache/, created on first use) is started with --workers workers, the same models pointed at
the same mock and a master key sent on every request, and gets the same wrk runs (JSON, stream, /v1/messages) and
paced run; `--litellm only` skips Portico.

The table: req/s, latency p50/p90/p99, errors (non-2xx answers + socket errors), and the CPU (% of one core) and
peak RSS of the gateway's processes (`portico serve`, its workers and Envoy; or LiteLLM's processes; summed RSS, so
shared pages count more than once), plus the CPU used by everything else on the machine during the run (other
work competes for the same cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import litellm, peers
from bench.common import (BENCH_ENV, CHAT_BODY, MESSAGES_BODY, PYTHON, ROOT, STREAM_BODY, Processes, Row, at_least,
                          create_key, ensure_wrk, lua_script, open_streams, paced, post, process_names, rss_bytes,
                          run_wrk, settle, subset_of, tree, wait_port, write_portico_config)
from gateway.envoy import free_ports

UPSTREAM_FLOOR = "upstream"  # in --floor: the handler that forwards to the mock instead of burning CPU
RUNS = ("direct", "json", "stream", "messages", "latency", "streams")  # --only's names


def smoke(base: str, key: str) -> None:
    """Each benchmarked request once, answered in full by the mock through Portico: else the numbers mean nothing."""
    checks = [("/v1/chat/completions", CHAT_BODY, b"fixed answer from the mock upstream"),
              ("/v1/chat/completions", STREAM_BODY, b"[DONE]"),
              ("/v1/messages", MESSAGES_BODY, b"fixed answer from the mock upstream")]
    for path, body, marker in checks:
        status, answer = post(base + path, body, key)
        if status != 200 or marker not in answer:
            raise RuntimeError(f"smoke check {path} stream={body.get('stream', False)} failed: {status} "
                               f"{answer[:300]!r}")
    status, answer = post(base + "/v1/chat/completions", CHAT_BODY, "pk-not-a-key")
    if status != 401:
        raise RuntimeError(f"a wrong key was not refused (status {status}): keys are not being checked")


# --- main -------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description="Benchmark Portico against a mock upstream.")
    p.add_argument("--workers", type=at_least(int, 1), default=1,
                   help="portico serve --workers N (N > 1 starts a redis-server); LiteLLM's --num_workers")
    p.add_argument("--duration", type=at_least(int, 1), default=10, help="seconds per wrk run (default 10)")
    p.add_argument("--connections", type=at_least(int, 1), default=32, help="wrk -c (default 32)")
    p.add_argument("--threads", type=at_least(int, 1), default=1, help="wrk -t (default 1)")
    p.add_argument("--rate", type=at_least(float, 0, exclusive=True), default=100.0,
                   help="paced latency run: requests/s per target (default 100)")
    p.add_argument("--latency-seconds", type=at_least(float, 0), default=10.0,
                   help="paced latency run length (default 10; 0: skip)")
    p.add_argument("--streams", type=at_least(int, 0), default=None,
                   help="streams held open at once (default 1000, with --peers 5000; 0: skip)")
    p.add_argument("--access-log", choices=["file", "off"], default="file",
                   help="the gateway's access log: to a file in the run directory (default) or off")
    p.add_argument("--only", default="", type=subset_of(RUNS), help="comma-separated subset of: " + ",".join(RUNS))
    p.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs, config) afterwards")
    p.add_argument("--floor", type=_floors, default=[],
                   help="comma-separated handler costs in µs, e.g. 0,100,200: the JSON load against the bare front "
                        "door with a handler that only uses that much CPU (bench/floor.py); 'upstream': a handler "
                        "that only forwards each request (JSON or streamed) to the mock and its answer back")
    p.add_argument("--litellm", nargs="?", const="with", choices=["with", "only"],
                   help="then the same runs against the LiteLLM proxy (litellm[proxy]==" + litellm.VERSION + ", its "
                        "own venv in .cache/, --workers workers); '--litellm only': LiteLLM without Portico")
    p.add_argument("--peers", action="store_true",
                   help="Portico, LiteLLM, Portkey and TensorZero side by side (bench/peers.py): interleaved JSON and "
                        "stream runs, the gateways not under test paused; installs the peers under .cache/ once")
    p.add_argument("--rounds", type=at_least(int, 1), default=2, help="--peers: interleaved rounds (default 2)")
    args = p.parse_args(argv)
    if args.threads > args.connections:
        p.error(f"argument --threads: {args.threads} threads need at least as many --connections (wrk's rule), "
                f"not {args.connections}")
    if args.peers and (args.only or args.litellm):
        p.error(f"argument {'--only' if args.only else '--litellm'}: not with --peers, which runs its own set "
                "(JSON and stream rounds for every gateway, then --streams open streams; --streams 0 skips those)")
    if args.json and not os.access(args.json.parent, os.W_OK):
        p.error(f"argument --json: cannot write into {args.json.parent}/ (no such directory, or not writable)")
    return args


def _floors(text: str) -> list[float | str]:
    """Handler costs in µs, and `upstream` for the handler that forwards to the mock (bench/floor.py)."""
    values: list[float | str] = []
    for part in filter(None, text.split(",")):
        if part == UPSTREAM_FLOOR:
            values.append(part)
            continue
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected microseconds like 0,100,200 or 'upstream', got {part!r}") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"handler costs are microseconds, 0 or more, not {part!r}")
        values.append(value)
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.streams is None:
        args.streams = peers.OPEN_STREAMS if args.peers else 1000
    only = set(filter(None, args.only.split(","))) or set(RUNS)
    wrk = ensure_wrk()
    run_dir = Path(tempfile.mkdtemp(prefix="portico-bench-"))
    procs = Processes()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_term)
    try:
        # Before any run: installing a peer may take minutes, once.
        litellm_bin = litellm.ensure_venv() if args.litellm or args.peers else None
        if args.peers:
            peers.ensure_portkey()
            peers.ensure_tensorzero()
            return _bench_peers(args, wrk, run_dir, procs, litellm_bin)
        return _bench(args, only, wrk, run_dir, procs, litellm_bin)
    except KeyboardInterrupt:
        print("bench: interrupted; stopping what it started", file=sys.stderr)
        return 130
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        if any(run_dir.iterdir()):  # empty when a peer's install failed: its log is under .cache/, named above
            print(f"bench: logs in {run_dir}", file=sys.stderr)
            args.keep = True
        return 1
    finally:
        # A second Ctrl-C while stopping would leave the rest running: they are in sessions of their own.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        procs.stop_all()
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"bench: run directory kept: {run_dir}", file=sys.stderr)
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])


def _bench(args, only: set[str], wrk: str, run_dir: Path, procs: Processes, litellm_bin: Path | None) -> int:
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "command": " ".join([Path(PYTHON).name, "-m", "bench", *sys.argv[1:]]),
        "workers": args.workers, "duration_s": args.duration, "connections": args.connections,
        "added_latency_p50_ms": None,
    }
    mock_port, port, admin_port, metrics_port, redis_port, litellm_port = free_ports(6)
    mock = procs.start("mock upstream", [PYTHON, "-m", "bench.mock_upstream", "--port", str(mock_port)], cwd=ROOT,
                       stdout=open(run_dir / "mock.log", "w"), stderr=subprocess.STDOUT)
    wait_port(mock_port, mock, 10, "the mock upstream")
    helpers = [mock.pid]
    upstream = f"http://127.0.0.1:{mock_port}/v1"
    (run_dir / "lua").mkdir()

    rows: list[Row] = []
    if "direct" in only:
        rows.append(run_wrk(wrk, "mock direct (JSON)", upstream + "/chat/completions",
                            lua_script(run_dir / "lua" / "direct.lua", {**CHAT_BODY, "model": "mock-gpt"}, None),
                            args, (None, helpers), run_dir))
    gateway_runs = only & {"json", "stream", "messages", "latency", "streams"}
    if args.litellm != "only" and gateway_runs:
        started = len(procs.started)
        rows += _portico(args, only, wrk, run_dir, procs, helpers, upstream, mock_port,
                         (port, admin_port, metrics_port, redis_port), results)
        for _, proc in reversed(procs.started[started:]):  # Portico (and its redis) off before LiteLLM starts
            procs.stop(proc)
    for handler in args.floor:
        rows += _floor(args, only, wrk, run_dir, procs, helpers, handler, (mock_port, port, admin_port))
    if litellm_bin and gateway_runs:
        rows += litellm.bench(litellm_bin, args, only, wrk, run_dir, procs, helpers, mock_port, litellm_port,
                              results)

    results["rows"] = [r.__dict__ for r in rows]
    results["targets"] = targets(rows, results, args)
    print()
    print(table(rows, results))
    if results["targets"]:
        print("\nTargets (issue 6), as this run measured them:\n" + "\n".join(results["targets"]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    failed = [r.name for r in rows if r.errors or r.note.startswith("wrk exit")]
    return 0 if not failed else 3


def start_portico(args, run_dir: Path, procs: Processes, helpers: list[int], upstream: str,
                  ports: tuple[int, int, int, int], results: dict) -> tuple[subprocess.Popen, str, str]:
    """`portico serve` on the mock, checked and described in `results`: (its process, base URL, the key)."""
    port, admin_port, metrics_port, redis_port = ports
    store = "memory"
    if args.workers > 1:
        redis_bin = shutil.which("redis-server")
        if not redis_bin:
            raise RuntimeError("--workers > 1 needs redis-server (Debian: apt-get install redis-server)")
        redis = procs.start("redis", [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=open(run_dir / "redis.log", "w"),
                            stderr=subprocess.STDOUT)
        wait_port(redis_port, redis, 10, "redis-server")
        helpers.append(redis.pid)  # the shared limit store: counted with the bench's helpers, not as "other"
        store = f"redis://127.0.0.1:{redis_port}/0"

    config_path = write_portico_config(run_dir, upstream, store=store, access_log=args.access_log == "file",
                                       streams=args.streams, ports=(port, admin_port, metrics_port))
    env = {**os.environ, **BENCH_ENV, "PYTHONUNBUFFERED": "1"}
    portico = [PYTHON, "-m", "server.cli", "--config", str(config_path), "--log-level", "warning"]
    key = create_key(config_path)

    gateway = procs.start("portico serve", [*portico, "serve", "--port", str(port), "--admin-port", str(admin_port),
                                            "--metrics-port", str(metrics_port), "--workers", str(args.workers)],
                          cwd=ROOT, env=env, stdout=open(run_dir / "portico.out", "w"),
                          stderr=open(run_dir / "portico.err", "w"))
    deadline = time.monotonic() + 120
    while "Portico is listening" not in (run_dir / "portico.out").read_text():
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("portico serve did not start:\n" + (run_dir / "portico.err").read_text()[-3000:])
        time.sleep(0.1)
    base = f"http://127.0.0.1:{port}"
    smoke(base, key)
    time.sleep(1)
    idle_rss = rss_bytes(tree(gateway.pid)) / 2**20
    names = process_names(gateway.pid)
    print(f"bench: gateway up: {len(names)} processes ({', '.join(names)}), idle RSS {idle_rss:.0f} MB", flush=True)

    results.update({"limits_store": store.split("://")[0], "access_log": args.access_log,
                    "gateway_processes": names, "gateway_idle_rss_mb": round(idle_rss, 1)})
    return gateway, base, key


def _bench_peers(args, wrk: str, run_dir: Path, procs: Processes, litellm_bin: Path) -> int:
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "command": " ".join([Path(PYTHON).name, "-m", "bench", *sys.argv[1:]]),
        "workers": args.workers, "duration_s": args.duration, "connections": args.connections,
    }
    mock_port, port, admin_port, metrics_port, redis_port, litellm_port, portkey_port = free_ports(7)
    mock = procs.start("mock upstream", [PYTHON, "-m", "bench.mock_upstream", "--port", str(mock_port)], cwd=ROOT,
                       stdout=open(run_dir / "mock.log", "w"), stderr=subprocess.STDOUT)
    wait_port(mock_port, mock, 10, "the mock upstream")
    helpers = [mock.pid]
    (run_dir / "lua").mkdir()
    upstream = f"http://127.0.0.1:{mock_port}/v1"
    gateway, base, key = start_portico(args, run_dir, procs, helpers, upstream,
                                       (port, admin_port, metrics_port, redis_port), results)
    gateways = [peers.Peer("portico (limits on, key checked)", gateway, base + "/v1/chat/completions",
                           "family-a-5.5", key=key)]
    gateways[0].pause()  # quiet while the others start
    proc, litellm_base, _ = litellm.start(litellm_bin, args, run_dir, procs, mock_port, litellm_port, results)
    gateways.append(peers.Peer(f"litellm {litellm.VERSION} ({args.workers} worker)", proc,
                               litellm_base + "/v1/chat/completions", "family-a-5.5", key=litellm.MASTER_KEY))
    gateways[1].pause()
    gateways.append(peers.start_portkey(procs, run_dir, portkey_port, mock_port))
    gateways[2].pause()
    gateways.append(peers.start_tensorzero(procs, run_dir, mock_port))
    for peer in gateways:
        peer.resume()
        peers.check(peer)
        peer.pause()
    # The floors take part in the JSON rounds like a gateway, so that their ratio to the peers is of the same
    # moments of this machine, whose speed drifts.
    for handler in args.floor:
        gateways.append(_start_floor(procs, run_dir, handler, (mock_port, *free_ports(2))))
        gateways[-1].pause()
    rows, by_run = peers.bench(gateways, args, wrk, run_dir, helpers)
    lines = peers.summary(gateways, by_run)
    # Portico alone (the peers paused): the open streams, for issue 15's verdicts.
    streams_row = None
    if args.streams > 0:
        gateways[0].resume()  # peers.bench leaves every gateway paused
        settle(gateway.pid, 5)
        streams_row = open_streams(args, port, key, (gateway.pid, helpers), "portico")
        rows.append(streams_row)
    gateways[0].pause()
    for peer in gateways:
        peer.resume()  # so that they can be stopped
    lines += peers.targets(gateways, by_run, streams_row, workers=args.workers)
    results["rows"] = [r.__dict__ for r in rows]
    results["peers"] = lines
    print()
    print(table(rows, results))
    print(f"\nSide by side: wrk -t{args.threads} -c{args.connections} {args.duration} s per run, {args.rounds} "
          "interleaved rounds, the same mock; the gateways not under test paused (SIGSTOP)")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if not any(r.errors or r.note.startswith("wrk exit") for r in rows) else 3


def _portico(args, only: set[str], wrk: str, run_dir: Path, procs: Processes, helpers: list[int], upstream: str,
             mock_port: int, ports: tuple[int, int, int, int], results: dict) -> list[Row]:
    gateway, base, key = start_portico(args, run_dir, procs, helpers, upstream, ports, results)
    port = ports[0]
    rows: list[Row] = []
    gw = (gateway.pid, helpers)
    for run, name, path, body in (("json", "portico chat JSON", "/v1/chat/completions", CHAT_BODY),
                                  ("stream", "portico chat stream", "/v1/chat/completions", STREAM_BODY),
                                  ("messages", "portico /v1/messages", "/v1/messages", MESSAGES_BODY)):
        if run in only:
            rows.append(run_wrk(wrk, name, base + path, lua_script(run_dir / "lua" / f"{run}.lua", body, key), args,
                                gw, run_dir))
    if "latency" in only and args.latency_seconds > 0:
        paced_rows, results["added_latency_p50_ms"] = paced(args, mock_port, port, key, gw, "Portico")
        rows += paced_rows
    if "streams" in only and args.streams > 0:
        rows.append(open_streams(args, port, key, gw, ""))
    return rows


def _start_floor(procs: Processes, run_dir: Path, handler: float | str, ports: tuple[int, int, int]) -> peers.Peer:
    """bench/floor.py, started and answering: its handler uses `handler` µs of CPU, or forwards to the mock
    (UPSTREAM_FLOOR). A Peer which says what its row measures; of JSON rounds only, but for the forwarding one."""
    mock_port, port, admin_port = ports
    if handler == UPSTREAM_FLOOR:
        label, options = "upstream call", ["--upstream", f"http://127.0.0.1:{mock_port}/v1"]
        measures = "front door + upstream exchange"
    else:
        label, options = f"handler {handler:g} us", ["--handler-us", str(handler)]
        measures = f"the front door + {handler:g} us of handler CPU" if handler else "the front door alone"
    name = f"floor, {label}"
    log = run_dir / f"floor-{label.replace(' ', '-')}.log"
    floor = procs.start(name, [PYTHON, "-m", "bench.floor", "--port", str(port), "--admin-port", str(admin_port),
                               *options], cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    # Its line, not its port: Envoy listens before bench.floor has seen it ready, and a floor paused in between
    # would find its readiness deadline passed when resumed, and exit.
    deadline = time.monotonic() + 30
    while "floor listening" not in log.read_text():
        if floor.poll() is not None or time.monotonic() > deadline:
            procs.stop(floor)
            raise RuntimeError(f"bench.floor did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    checks = [(CHAT_BODY, b"fixed answer")] + ([(STREAM_BODY, b"[DONE]")] if handler == UPSTREAM_FLOOR else [])
    for body, expected in checks:
        status, answer = post(url, body, None)
        if status != 200 or expected not in answer:
            procs.stop(floor)
            raise RuntimeError(f"the floor server answered {status}: {answer[:300]!r}")
    return peers.Peer(name, floor, url, "family-a-5.5", json_only=handler != UPSTREAM_FLOOR, measures=measures)


def _floor(args, only: set[str], wrk: str, run_dir: Path, procs: Processes, helpers: list[int],
           handler: float | str, ports: tuple[int, int, int]) -> list[Row]:
    """The JSON wrk run against bench/floor.py; with `stream` in --only, the streamed one too (the forwarding floor),
    and with `latency`, the paced run."""
    floor = _start_floor(procs, run_dir, handler, ports)
    try:
        rows = [run_wrk(wrk, floor.name, floor.url, lua_script(run_dir / "lua" / "floor.lua", CHAT_BODY, None), args,
                        (floor.proc.pid, helpers), run_dir)]
        if not floor.json_only and "stream" in only:
            rows.append(run_wrk(wrk, f"{floor.name} stream", floor.url,
                                lua_script(run_dir / "lua" / "floor-stream.lua", STREAM_BODY, None), args,
                                (floor.proc.pid, helpers), run_dir))
        if "latency" in only and args.latency_seconds > 0:
            rows += paced(args, ports[0], ports[1], "none", (floor.proc.pid, helpers), floor.name.replace(",", ""))[0]
        return rows
    finally:
        procs.stop(floor.proc)


def targets(rows: list[Row], results: dict, args) -> list[str]:
    """Each target this run measured under the conditions it names (wrk -c32, 100 req/s paced, 1,000 streams)."""
    by_name = {r.name: r for r in rows}
    lines = []

    def verdict(ok: bool, target: str, measured: str) -> None:
        lines.append(f"  {'met   ' if ok else 'MISSED'}  {target}: {measured}")

    for kind, floor in (("chat JSON", 2200), ("chat stream", 800)):
        if (row := by_name.get(f"portico {kind}")) and args.connections == 32:
            verdict(row.rps >= floor and not row.errors, f">= {floor:,} {kind} req/s at c=32, zero errors",
                    f"{row.rps:,.0f} req/s, {row.errors} errors")
    if (added := results.get("added_latency_p50_ms")) is not None and args.rate == 100:
        verdict(added <= 1.0, "added p50 <= 1 ms at 100 req/s", f"{added:+.2f} ms")
    if (row := by_name.get("1000 open streams")) and row.gateway_rss_mb is not None:
        verdict(not row.errors and row.gateway_rss_mb <= 300, "1,000 open streams served, gateway RSS <= 300 MB",
                f"{row.requests - row.errors} served, {row.gateway_rss_mb:.0f} MB")
    for kind in ("chat JSON", "chat stream", "/v1/messages"):
        ours, theirs = by_name.get(f"portico {kind}"), by_name.get(f"litellm {kind}")
        if ours and theirs and theirs.rps > 0 and args.connections == 32:
            # wrk counts error answers in req/s: a ratio reached with errors is not reached
            verdict(ours.rps >= 20 * theirs.rps and not ours.errors, f">= 20x LiteLLM, {kind}",
                    f"{ours.rps / theirs.rps:.1f}x" + (f", {ours.errors} errors" if ours.errors else ""))
    return lines


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    return f"{os.cpu_count()} CPUs ({cpu}), {mem} MB RAM, {platform.system()} {platform.release()}, " \
           f"Python {platform.python_version()}, load average before {os.getloadavg()[0]:.1f}"


def table(rows: list[Row], results: dict) -> str:
    f = (lambda v, spec: format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec))
    head = (f"{'run':<26} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'requests':>9} {'errors':>7} "
            f"{'gw CPU%':>8} {'gw RSS MB':>9} {'gw PSS MB':>9} {'other CPU%':>10}  note")
    gateways = " and ".join(name for name, key in (("Portico", "gateway_processes"), ("LiteLLM", "litellm"))
                            if key in results)
    if "peers" in results:
        gateways = "Portico, LiteLLM, Portkey and TensorZero"
    lines = [f"{gateways or 'Gateway'} benchmark, {results['date']}: workers={results['workers']}, "
             f"wrk -c{results['connections']} {results['duration_s']} s", f"machine: {results['machine']}"]
    if "gateway_processes" in results:
        lines.append(f"portico: limits={results['limits_store']}, access log={results['access_log']}; processes: "
                     f"{', '.join(results['gateway_processes'])}; idle RSS {results['gateway_idle_rss_mb']} MB")
    if "litellm" in results:
        lines.append(litellm.describe(results["litellm"]))
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<26} {r.rps:>8.0f} {f(r.p50, '8.2f')} {f(r.p90, '8.2f')} {f(r.p99, '8.2f')} "
                     f"{r.requests:>9} {r.errors:>7} {f(r.gateway_cpu, '8.0f')} {f(r.gateway_rss_mb, '9.0f')} "
                     f"{f(r.gateway_pss_mb, '9.0f')} "
                     f"{f(r.other_cpu, '10.0f')}  {r.note}")
    lines.append("CPU% is of one core (200% = 2 cores); 'gw': the row's gateway (Portico: portico serve, its workers "
                 "and Envoy; LiteLLM: its processes); 'other': every process but that gateway, the mock, redis and "
                 "the load generator. RSS/PSS: peak, summed over the gateway's processes (RSS counts shared pages "
                 "once per process, PSS splits them).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
