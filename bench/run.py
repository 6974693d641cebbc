"""Portico's benchmark: one command, everything on 127.0.0.1, everything it starts stopped at the end.

    make bench                                   # = .venv/bin/python -m bench
    .venv/bin/python -m bench --workers 2 --duration 10 --streams 1000

It installs `wrk` (Debian) when missing, starts the mock upstream (bench/mock_upstream.py) and `portico serve` with
a generated configuration pointing family-a-5.5 (chat), family-b-sonnet-4-6 (messages) and family-a-5.4 (a slow
stream, for the open-streams run) at the mock, limits enabled (in-process, or a private redis-server with
--workers > 1) and a key checked on every request. Then:

1. wrk -t1 -c32 for --duration s each against the mock directly (the limit), Portico JSON chat completions, Portico
   streamed chat completions and Portico /v1/messages;
2. a paced run at --rate req/s to the mock and to Portico in turn (bench/client.py), for the added latency;
3. --streams streams held open at once (20 chunks 0.25 s apart), for the gateway's memory under many streams.

The table: req/s, latency p50/p90/p99, errors (non-2xx answers + socket errors), and the CPU (% of one core) and
peak RSS of the gateway's processes (`portico serve`, its workers and Envoy; summed RSS, so shared pages count
more than once), plus the CPU used by everything else on the machine during the run (other work competes for
the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench import client
from gateway.envoy import free_ports

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

CHAT_BODY = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32}
STREAM_BODY = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}}
MESSAGES_BODY = {"model": "family-b-sonnet-4-6", "max_tokens": 32,
                 "messages": [{"role": "user", "content": "Say hello."}]}
SLOW_BODY = {"model": "family-a-5.4", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 64,
             "stream": True}


# --- /proc accounting -------------------------------------------------------------------------------------------

def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    return children


def tree(root: int) -> list[int]:
    children, out, todo = _children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError):
            pass
    return total


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError):
            pass
    return total


def pss_bytes(pids: list[int]) -> int:
    """Proportional set size: shared pages divided among the processes sharing them (no double counting)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, IndexError, ValueError):
            pass
    return total


def machine_busy_ticks() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


class Sampler:
    """CPU over a run (gateway, bench helpers, whole machine) and the gateway's peak RSS (sampled every 0.2 s)."""

    def __init__(self, gateway_root: int | None, helper_pids: list[int]) -> None:
        self.gateway_root, self.helper_pids = gateway_root, helper_pids
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _gateway(self) -> list[int]:
        return tree(self.gateway_root) if self.gateway_root else []

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            pids = self._gateway()
            self.peak_rss = max(self.peak_rss, rss_bytes(pids))
            self.peak_pss = max(self.peak_pss, pss_bytes(pids))

    def __enter__(self) -> "Sampler":
        self.t0 = time.monotonic()
        self.gw0, self.machine0 = cpu_ticks(self._gateway()), machine_busy_ticks()
        self.helpers0 = cpu_ticks(self.helper_pids) + self._own_ticks()
        self.peak_rss = rss_bytes(self._gateway())
        self.peak_pss = pss_bytes(self._gateway())
        self._thread.start()
        return self

    @staticmethod
    def _own_ticks() -> int:
        t = os.times()  # this process and its reaped children (wrk)
        return int((t.user + t.system + t.children_user + t.children_system) * TICK)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.monotonic() - self.t0
        gw = cpu_ticks(self._gateway()) - self.gw0
        helpers = cpu_ticks(self.helper_pids) + self._own_ticks() - self.helpers0
        machine = machine_busy_ticks() - self.machine0
        self.gateway_cpu = 100.0 * gw / TICK / self.seconds
        self.bench_cpu = 100.0 * helpers / TICK / self.seconds
        self.other_cpu = max(0.0, 100.0 * (machine - gw - helpers) / TICK / self.seconds)


# --- processes --------------------------------------------------------------------------------------------------

class Processes:
    """Everything started, stopped in reverse order: SIGTERM, then SIGKILL of the whole tree after a grace."""

    def __init__(self) -> None:
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        self.started.append((name, proc))
        return proc

    def stop_all(self) -> None:
        for name, proc in reversed(self.started):
            if proc.poll() is not None:
                continue
            pids = tree(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                print(f"bench: {name} did not stop in 20 s; killing it", file=sys.stderr)
            for pid in pids:  # whatever is left of its tree (workers, Envoy)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        self.started.clear()


def wait_port(port: int, proc: subprocess.Popen, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} is not listening on {port} after {seconds:g} s")


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    print("bench: installing wrk (apt-get)...", flush=True)
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True)
    subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "wrk"], check=True)
    return shutil.which("wrk") or "wrk"


# --- wrk --------------------------------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    rps: float = 0.0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    requests: int = 0
    errors: int = 0
    gateway_cpu: float | None = None
    gateway_rss_mb: float | None = None
    gateway_pss_mb: float | None = None
    other_cpu: float | None = None
    bench_cpu: float | None = None
    note: str = ""


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def parse_wrk(text: str, row: Row) -> Row:
    if m := re.search(r"Requests/sec:\s+([\d.]+)", text):
        row.rps = float(m.group(1))
    if m := re.search(r"(\d+) requests in", text):
        row.requests = int(m.group(1))
    for pct, attr in (("50", "p50"), ("90", "p90"), ("99", "p99")):
        if m := re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M):
            setattr(row, attr, _ms(m.group(1), m.group(2)))
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", text):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text):
        errors += sum(int(x) for x in m.groups())
    row.errors = errors
    return row


def lua_script(path: Path, body: dict, key: str | None) -> Path:
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(body, separators=(',', ':')))}",
             'wrk.headers["Content-Type"] = "application/json"']
    if key:
        lines.append(f'wrk.headers["Authorization"] = "Bearer {key}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def run_wrk(wrk: str, name: str, url: str, script: Path, args, sampler_args, log_dir: Path) -> Row:
    command = [wrk, f"-t{args.threads}", f"-c{args.connections}", f"-d{args.duration}s", "--timeout", "10s",
               "--latency", "-s", str(script), url]
    print(f"bench: {name}: {' '.join(command)}", flush=True)
    with Sampler(*sampler_args) as sample:
        out = subprocess.run(command, capture_output=True, text=True, timeout=args.duration + 60)
    (log_dir / f"wrk-{name.replace(' ', '_').replace('/', '_')}.txt").write_text(out.stdout + out.stderr)
    row = parse_wrk(out.stdout, Row(name))
    if out.returncode != 0:
        row.note = f"wrk exit {out.returncode}: {out.stderr.strip()[:200]}"
    row.gateway_cpu = sample.gateway_cpu if sampler_args[0] else None
    row.gateway_rss_mb = sample.peak_rss / 2**20 if sampler_args[0] else None
    row.gateway_pss_mb = sample.peak_pss / 2**20 if sampler_args[0] else None
    row.other_cpu, row.bench_cpu = sample.other_cpu, sample.bench_cpu
    return row


# --- checks -----------------------------------------------------------------------------------------------------

def post(url: str, body: dict, key: str | None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


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
    p.add_argument("--workers", type=int, default=1, help="portico serve --workers N (N > 1 starts a redis-server)")
    p.add_argument("--duration", type=int, default=10, help="seconds per wrk run (default 10)")
    p.add_argument("--connections", type=int, default=32, help="wrk -c (default 32)")
    p.add_argument("--threads", type=int, default=1, help="wrk -t (default 1)")
    p.add_argument("--rate", type=float, default=100.0, help="paced latency run: requests/s per target (default 100)")
    p.add_argument("--latency-seconds", type=float, default=10.0, help="paced latency run length (default 10; 0: skip)")
    p.add_argument("--streams", type=int, default=1000, help="streams held open at once (default 1000; 0: skip)")
    p.add_argument("--access-log", choices=["file", "off"], default="file",
                   help="the gateway's access log: to a file in the run directory (default) or off")
    p.add_argument("--only", default="", help="comma-separated subset of: direct,json,stream,messages,latency,streams")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs, config) afterwards")
    p.add_argument("--litellm", action="store_true", help="(not implemented) the same load against LiteLLM")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.litellm:
        print("bench: --litellm is not implemented; the LiteLLM figures in docs/performance.md come from the "
              "architecture notes", file=sys.stderr)
        return 2
    only = set(filter(None, args.only.split(","))) or {"direct", "json", "stream", "messages", "latency", "streams"}
    wrk = ensure_wrk()
    run_dir = Path(tempfile.mkdtemp(prefix="portico-bench-"))
    procs = Processes()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return _bench(args, only, wrk, run_dir, procs)
    except KeyboardInterrupt:
        print("bench: interrupted; stopping what it started", file=sys.stderr)
        return 130
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"bench: {exc}\nbench: logs in {run_dir}", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        procs.stop_all()
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"bench: run directory kept: {run_dir}", file=sys.stderr)


def _bench(args, only: set[str], wrk: str, run_dir: Path, procs: Processes) -> int:
    mock_port, port, admin_port, metrics_port, redis_port = free_ports(5)
    mock = procs.start("mock upstream", [PYTHON, "-m", "bench.mock_upstream", "--port", str(mock_port)], cwd=ROOT,
                       stdout=open(run_dir / "mock.log", "w"), stderr=subprocess.STDOUT)
    wait_port(mock_port, mock, 10, "the mock upstream")
    helpers = [mock.pid]

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

    upstream = f"http://127.0.0.1:{mock_port}/v1"
    provider = {"kind": "openai", "base_url": upstream, "api_key_env": "BENCH_UPSTREAM_KEY", "model": "mock-gpt",
                "max_connections": 100}
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "envoy_admin_port": admin_port, "metrics_port": metrics_port,
        "access_log": str(run_dir / "access.log") if args.access_log == "file" else "off",
        "drain_seconds": 2, "data_dir": str(run_dir / "data"),
        "limits": {"store": store},
        "models": [
            {"id": "family-a-5.5", "endpoint": "/v1/chat/completions", "owned_by": "family-a", "created": 1767225600,
             "provider": provider},
            {"id": "family-b-sonnet-4-6", "endpoint": "/v1/messages", "owned_by": "family-b", "created": 1762041600,
             "provider": provider},
            # the open-streams run: one upstream connection per open stream, so the pool must hold them all
            {"id": "family-a-5.4", "endpoint": "/v1/chat/completions", "owned_by": "family-a", "created": 1759276800,
             "provider": {**provider, "model": "mock-slow", "max_connections": max(100, args.streams + 100)}},
        ],
    }
    config_path = run_dir / "portico.yaml"
    config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    env = {**os.environ, "BENCH_UPSTREAM_KEY": "sk-bench-mock", "PYTHONUNBUFFERED": "1"}
    portico = [PYTHON, "-m", "server.cli", "--config", str(config_path), "--log-level", "warning"]
    created = subprocess.run([*portico, "keys", "create", "--name", "bench", "--all-models", "--rpm", "1000000000",
                              "--tpm", "1000000000000", "--concurrency", "100000"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if created.returncode != 0:
        raise RuntimeError(f"keys create failed: {created.stderr}")
    key = created.stdout.strip().splitlines()[-1]

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
    pids = tree(gateway.pid)
    names = sorted(Path(f"/proc/{p}/comm").read_text().strip() for p in pids if Path(f"/proc/{p}/comm").exists())
    print(f"bench: gateway up: {len(pids)} processes ({', '.join(names)}), idle RSS {idle_rss:.0f} MB", flush=True)

    rows: list[Row] = []
    scripts = run_dir / "lua"
    scripts.mkdir()
    gw = (gateway.pid, helpers)
    none = (None, helpers)
    if "direct" in only:
        rows.append(run_wrk(wrk, "mock direct (JSON)", upstream + "/chat/completions",
                            lua_script(scripts / "direct.lua", {**CHAT_BODY, "model": "mock-gpt"}, None),
                            args, none, run_dir))
    if "json" in only:
        rows.append(run_wrk(wrk, "portico chat JSON", base + "/v1/chat/completions",
                            lua_script(scripts / "json.lua", CHAT_BODY, key), args, gw, run_dir))
    if "stream" in only:
        rows.append(run_wrk(wrk, "portico chat stream", base + "/v1/chat/completions",
                            lua_script(scripts / "stream.lua", STREAM_BODY, key), args, gw, run_dir))
    if "messages" in only:
        rows.append(run_wrk(wrk, "portico /v1/messages", base + "/v1/messages",
                            lua_script(scripts / "messages.lua", MESSAGES_BODY, key), args, gw, run_dir))

    latency = None
    if "latency" in only and args.latency_seconds > 0:
        latency = _paced(args, mock_port, port, key, gw)
        rows.extend(latency[0])

    streams = None
    if "streams" in only and args.streams > 0:
        streams = _open_streams(args, port, key, gw)
        rows.append(streams)

    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "command": " ".join([Path(PYTHON).name, "-m", "bench", *sys.argv[1:]]),
        "workers": args.workers, "duration_s": args.duration, "connections": args.connections,
        "limits_store": store.split("://")[0], "access_log": args.access_log,
        "gateway_processes": names, "gateway_idle_rss_mb": round(idle_rss, 1),
        "rows": [r.__dict__ for r in rows],
        "added_latency_p50_ms": latency[1] if latency else None,
    }
    print()
    print(table(rows, results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    failed = [r.name for r in rows if r.errors or r.note.startswith("wrk exit")]
    return 0 if not failed else 3


def _paced(args, mock_port: int, port: int, key: str, gw) -> tuple[list[Row], float | None]:
    headers = {"Content-Type": "application/json"}
    direct = ("127.0.0.1", mock_port, "/v1/chat/completions",
              json.dumps({**CHAT_BODY, "model": "mock-gpt"}).encode(), headers, b"fixed answer")
    through = ("127.0.0.1", port, "/v1/chat/completions", json.dumps(CHAT_BODY).encode(),
               {**headers, "Authorization": f"Bearer {key}"}, b"fixed answer")
    print(f"bench: paced: {args.rate:g} req/s to the mock and {args.rate:g} req/s to Portico (JSON chat), "
          f"{args.latency_seconds:g} s", flush=True)
    with Sampler(*gw) as sample:
        results = asyncio.run(client.paced([direct, through], args.rate, args.latency_seconds))
    rows = []
    for name, result in zip(("paced mock direct", "paced portico JSON"), results):
        lat = sorted(result.latencies_ms)
        pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None)
        rows.append(Row(name, rps=len(lat) / args.latency_seconds, p50=pct(0.5), p90=pct(0.9), p99=pct(0.99),
                        requests=len(lat) + result.errors, errors=result.errors,
                        note=f"{result.late} sends late" if result.late else ""))
    rows[1].gateway_cpu, rows[1].gateway_rss_mb = sample.gateway_cpu, sample.peak_rss / 2**20
    rows[1].gateway_pss_mb = sample.peak_pss / 2**20
    rows[1].other_cpu = rows[0].other_cpu = sample.other_cpu
    added = rows[1].p50 - rows[0].p50 if rows[0].p50 is not None and rows[1].p50 is not None else None
    if added is not None:
        rows[1].note = (rows[1].note + "; " if rows[1].note else "") + f"added p50 {added:.2f} ms"
    return rows, added


def _open_streams(args, port: int, key: str, gw) -> Row:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    print(f"bench: {args.streams} streams open at once (20 chunks 0.25 s apart each)", flush=True)
    with Sampler(*gw) as sample:
        ok, failed, seconds = asyncio.run(client.open_streams(
            "127.0.0.1", port, "/v1/chat/completions", json.dumps(SLOW_BODY).encode(), headers, b"[DONE]",
            args.streams, ramp_seconds=2.0, timeout=90))
    return Row(f"{args.streams} open streams", rps=ok / seconds, requests=ok + failed, errors=failed,
               gateway_cpu=sample.gateway_cpu, gateway_rss_mb=sample.peak_rss / 2**20,
               gateway_pss_mb=sample.peak_pss / 2**20, other_cpu=sample.other_cpu,
               note=f"{ok} completed in {seconds:.1f} s (each ~5 s)")


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    return f"{os.cpu_count()} CPUs ({cpu}), {mem} MB RAM, {platform.system()} {platform.release()}, " \
           f"Python {platform.python_version()}, load average before {os.getloadavg()[0]:.1f}"


def table(rows: list[Row], results: dict) -> str:
    f = (lambda v, spec: format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec))
    head = (f"{'run':<24} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'requests':>9} {'errors':>7} "
            f"{'gw CPU%':>8} {'gw RSS MB':>9} {'gw PSS MB':>9} {'other CPU%':>10}  note")
    lines = [f"Portico benchmark, {results['date']}: workers={results['workers']}, limits={results['limits_store']}, "
             f"access log={results['access_log']}, wrk -c{results['connections']} {results['duration_s']} s",
             f"machine: {results['machine']}",
             f"gateway processes: {', '.join(results['gateway_processes'])}; idle RSS "
             f"{results['gateway_idle_rss_mb']} MB", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<24} {r.rps:>8.0f} {f(r.p50, '8.2f')} {f(r.p90, '8.2f')} {f(r.p99, '8.2f')} "
                     f"{r.requests:>9} {r.errors:>7} {f(r.gateway_cpu, '8.0f')} {f(r.gateway_rss_mb, '9.0f')} "
                     f"{f(r.gateway_pss_mb, '9.0f')} "
                     f"{f(r.other_cpu, '10.0f')}  {r.note}")
    lines.append("CPU% is of one core (200% = 2 cores); 'other': every process but the gateway, the mock, redis and "
                 "the load generator. RSS/PSS: peak, summed over the gateway's processes (RSS counts shared pages "
                 "once per process, PSS splits them).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
