"""What the benchmark's runs share: the request bodies, /proc accounting of a process tree (CPU, RSS, PSS), the
processes it starts (stopped as whole trees), wrk runs and their parsing, and the paced latency run."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import client

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
BENCH_ENV = {"BENCH_UPSTREAM_KEY": "sk-bench-mock"}  # the upstream key Portico sends the mock


def subset_of(names: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type for `--only a,b`: a name not in `names` is an error, not a run that measures nothing."""
    def check(text: str) -> str:
        unknown = [part for part in text.split(",") if part and part not in names]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}: expected a subset of {','.join(names)}")
        return text
    return check


def at_least(kind: type[int] | type[float], minimum: float, *, exclusive: bool = False) -> Callable[[str], float]:
    """An argparse type for a count or a time: a value no run can use (`--duration 0`, `--rate nan`) is refused
    while parsing, in one line, rather than found out by wrk or a division minutes into the run."""
    bound = f"above {minimum:g}" if exclusive else f"at least {minimum:g}"

    def check(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return check


def write_portico_config(run_dir: Path, upstream: str, *, store: str = "memory", access_log: bool = True,
                         streams: int = 0, ports: tuple[int, int, int] = (8080, 9901, 9464)) -> Path:
    """The benchmarked configuration: family-a-5.5 (chat) and family-b-sonnet-4-6 (messages, translated to chat
    completions) on the mock at `upstream`, family-a-5.4 on its slow stream; limits in `store`."""
    port, admin_port, metrics_port = ports
    provider = {"kind": "openai", "base_url": upstream, "api_key_env": "BENCH_UPSTREAM_KEY", "model": "mock-gpt",
                "max_connections": 100}
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "envoy_admin_port": admin_port, "metrics_port": metrics_port,
        "access_log": str(run_dir / "access.log") if access_log else "off",
        "drain_seconds": 2, "data_dir": str(run_dir / "data"),
        "limits": {"store": store},
        "models": [
            {"id": "family-a-5.5", "endpoint": "/v1/chat/completions", "owned_by": "family-a", "created": 1767225600,
             "provider": provider},
            {"id": "family-b-sonnet-4-6", "endpoint": "/v1/messages", "owned_by": "family-b", "created": 1762041600,
             "provider": provider},
            # the open-streams run: one upstream connection per open stream, so the pool must hold them all
            {"id": "family-a-5.4", "endpoint": "/v1/chat/completions", "owned_by": "family-a", "created": 1759276800,
             "provider": {**provider, "model": "mock-slow", "max_connections": max(100, streams + 100)}},
        ],
    }
    path = run_dir / "portico.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def create_key(config_path: Path) -> str:
    """A key for every model, with limits no run reaches (they are still checked on every request)."""
    created = subprocess.run([PYTHON, "-m", "server.cli", "--config", str(config_path), "--log-level", "warning",
                              "keys", "create", "--name", "bench", "--all-models", "--rpm", "1000000000",
                              "--tpm", "2000000000", "--concurrency", "100000"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    if created.returncode != 0:
        raise RuntimeError(f"keys create failed: {created.stderr}")
    return created.stdout.strip().splitlines()[-1]



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


def _summed(pids: list[int], read: Callable[[int], int]) -> int:
    """`read(pid)` summed over the processes; one that has gone (or whose /proc entry reads oddly) counts 0."""
    total = 0
    for pid in pids:
        try:
            total += read(pid)
        except (OSError, IndexError, ValueError):
            pass
    return total


def _cpu_ticks(pid: int, stat: str = "") -> int:
    """utime + stime of a process (all its threads), or of one thread given its `stat` file."""
    fields = Path(stat or f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def _pss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_ticks(pids: list[int]) -> int:
    return _summed(pids, _cpu_ticks)


def rss_bytes(pids: list[int]) -> int:
    return _summed(pids, _rss_bytes)


def pss_bytes(pids: list[int]) -> int:
    """Proportional set size: shared pages divided among the processes sharing them (no double counting)."""
    return _summed(pids, _pss_bytes)


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

    def _ticks(self) -> tuple[int, int, int, bool]:
        """CPU ticks of the gateway's whole tree, of its Envoy processes (Portico's and the floors'), and of the
        main threads of its other processes, where a Python server's event loop runs (grpc-core's and the
        ledger's threads are the process's others); and whether it has an Envoy. From one walk of the tree."""
        pids = self._gateway()
        envoy = [pid for pid in pids if _comm(pid) == "envoy"]
        others = [pid for pid in pids if pid not in envoy]
        return (cpu_ticks(pids), cpu_ticks(envoy),
                _summed(others, lambda pid: _cpu_ticks(pid, f"/proc/{pid}/task/{pid}/stat")), bool(envoy))

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            pids = self._gateway()
            self.peak_rss = max(self.peak_rss, rss_bytes(pids))
            self.peak_pss = max(self.peak_pss, pss_bytes(pids))

    def __enter__(self) -> "Sampler":
        self.t0 = time.monotonic()
        self.gw0, self.envoy0, self.loop0, self.has_envoy = self._ticks()
        self.machine0 = machine_busy_ticks()
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
        gw, envoy, loop, _ = self._ticks()
        gw = self.gateway_ticks = gw - self.gw0
        self.envoy_ticks, self.loop_ticks = envoy - self.envoy0, loop - self.loop0
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

    def stop(self, proc: subprocess.Popen) -> None:
        for name, started in self.started:
            if started is proc:
                self._stop(name, proc)
        self.started = [(n, p) for n, p in self.started if p is not proc]

    def stop_all(self) -> None:
        for name, proc in reversed(self.started):
            self._stop(name, proc)
        self.started.clear()

    @staticmethod
    def _stop(name: str, proc: subprocess.Popen) -> None:
        if proc.poll() is not None:
            return
        pids = tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        for pid in pids:  # a gateway paused for the peers' rounds acts on its SIGTERM only once continued
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
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
    cpu_ms: float | None = None  # the gateway's CPU (its whole process tree) per completed request
    envoy_cpu_ms: float | None = None  # the part of cpu_ms spent in the gateway's Envoy (None: it has none)
    loop_cpu_ms: float | None = None  # with an Envoy: the part spent in the main threads of the other processes
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


def lua_script(path: Path, body: dict, key: str | None, headers: dict[str, str] | None = None) -> Path:
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(body, separators=(',', ':')))}",
             'wrk.headers["Content-Type"] = "application/json"']
    if key:
        lines.append(f'wrk.headers["Authorization"] = "Bearer {key}"')
    lines += [f"wrk.headers[{json.dumps(name)}] = {json.dumps(value)}" for name, value in (headers or {}).items()]
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
    if sampler_args[0] and row.requests:
        row.cpu_ms = sample.gateway_ticks / TICK * 1000 / row.requests
        if sample.has_envoy:
            row.envoy_cpu_ms = sample.envoy_ticks / TICK * 1000 / row.requests
            row.loop_cpu_ms = sample.loop_ticks / TICK * 1000 / row.requests
    return row


# --- checks -----------------------------------------------------------------------------------------------------

def post(url: str, body: dict, key: str | None, extra: dict[str, str] | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
               **(extra or {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()



def paced(args, mock_port: int, port: int, key: str, sampler_args, gateway: str) -> tuple[list[Row], float | None]:
    """`--rate` req/s of JSON chat to the mock and as many to the gateway on `port`, in turn, for the added latency."""
    headers = {"Content-Type": "application/json"}
    direct = ("127.0.0.1", mock_port, "/v1/chat/completions",
              json.dumps({**CHAT_BODY, "model": "mock-gpt"}).encode(), headers, b"fixed answer")
    through = ("127.0.0.1", port, "/v1/chat/completions", json.dumps(CHAT_BODY).encode(),
               {**headers, "Authorization": f"Bearer {key}"}, b"fixed answer")
    print(f"bench: paced: {args.rate:g} req/s to the mock and {args.rate:g} req/s to {gateway} (JSON chat), "
          f"{args.latency_seconds:g} s", flush=True)
    with Sampler(*sampler_args) as sample:
        results = asyncio.run(client.paced([direct, through], args.rate, args.latency_seconds))
    rows = []
    for name, result in zip(("paced mock direct", f"paced {gateway.lower()} JSON"), results):
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


def settle(root: int, seconds: float, busy_percent: float = 15.0) -> None:
    """Wait (at most `seconds`) until the process tree under `root` uses less than `busy_percent` of a core over
    half a second: a server that answers may still be starting workers or warming up."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = cpu_ticks(tree(root))
        time.sleep(0.5)
        if 100.0 * (cpu_ticks(tree(root)) - before) / TICK / 0.5 < busy_percent:
            return


def open_streams(args, port: int, key: str, sampler_args, name: str) -> Row:
    """`--streams` slow streams (20 chunks 0.25 s apart) held open at once, each on its own connection."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    print(f"bench: {name or 'portico'}: {args.streams} streams open at once (20 chunks 0.25 s apart each)",
          flush=True)
    with Sampler(*sampler_args) as sample:
        ok, failed, seconds = asyncio.run(client.open_streams(
            "127.0.0.1", port, "/v1/chat/completions", json.dumps(SLOW_BODY).encode(), headers, b"[DONE]",
            args.streams, ramp_seconds=2.0, timeout=90))
    return Row(f"{name} {args.streams} open streams".strip(), rps=ok / seconds, requests=ok + failed, errors=failed,
               gateway_cpu=sample.gateway_cpu, gateway_rss_mb=sample.peak_rss / 2**20,
               gateway_pss_mb=sample.peak_pss / 2**20, other_cpu=sample.other_cpu,
               note=f"{ok} completed in {seconds:.1f} s (each ~5 s)")


def process_names(root: int) -> list[str]:
    return sorted(name for pid in tree(root) if (name := _comm(pid)))
