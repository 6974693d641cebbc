"""A minimal asyncio HTTP/1.1 client (keep-alive, Content-Length or chunked answers) for the paced latency run and
the many-open-streams run: no library in the measurement path, and the same code against the mock and the gateway."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


class HttpConnection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _ensure(self) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        await self._ensure()
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        self.writer.write(head.encode() + body)
        try:
            return await self._read_response()
        except BaseException:
            self.close()
            raise

    async def _read_response(self) -> tuple[int, bytes]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                parts.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            body = b"".join(parts)
        else:
            body = await self.reader.read()
            self.close()
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.writer = None


@dataclass
class Paced:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    late: int = 0  # sends that could not start on time (no idle connection): the client was the bottleneck


async def paced(targets: list[tuple[str, int, str, bytes, dict, bytes]], rate: float, duration: float,
                pool: int = 8) -> list[Paced]:
    """Open-loop load: every 1/rate s, one request to each target in turn (spread evenly within the period), so
    both see the same background load. A target: (host, port, path, body, headers, a marker the answer must
    contain). Latency: from writing the request to the answer's last byte."""
    results = [Paced() for _ in targets]
    idle = [[HttpConnection(t[0], t[1]) for _ in range(pool)] for t in targets]
    for conns, t in zip(idle, targets):  # open connections before timing anything
        for c in conns:
            await c._ensure()
    tasks: set[asyncio.Task] = set()

    async def one(i: int) -> None:
        host, port, path, body, headers, marker = targets[i]
        if not idle[i]:
            results[i].late += 1
            conn = HttpConnection(host, port)
        else:
            conn = idle[i].pop()
        start = time.perf_counter()
        try:
            status, answer = await conn.post(path, body, headers)
            elapsed = (time.perf_counter() - start) * 1000
            if status == 200 and marker in answer:
                results[i].latencies_ms.append(elapsed)
            else:
                results[i].errors += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            results[i].errors += 1
        idle[i].append(conn)

    loop = asyncio.get_running_loop()
    period = 1.0 / rate
    slot = period / len(targets)
    t0 = loop.time() + 0.05
    n = int(duration * rate)
    for k in range(n):
        for i in range(len(targets)):
            at = t0 + k * period + i * slot
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    for conns in idle:
        for c in conns:
            c.close()
    return results


async def open_streams(host: str, port: int, path: str, body: bytes, headers: dict, marker: bytes,
                       count: int, ramp_seconds: float, timeout: float) -> tuple[int, int, float]:
    """`count` streamed requests at once (started over `ramp_seconds`), each on its own connection, read to the
    end. Returns (completed with the marker, failed, seconds to finish all)."""
    ok = failed = 0
    reasons: dict[str, int] = {}

    async def one(k: int) -> None:
        nonlocal ok, failed
        await asyncio.sleep(ramp_seconds * k / count)
        conn = HttpConnection(host, port)
        try:
            status, answer = await conn.post(path, body, headers)
            if status == 200 and marker in answer:
                ok += 1
            else:
                failed += 1
                why = f"status {status}: {answer[:120]!r}"
                reasons[why] = reasons.get(why, 0) + 1
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            failed += 1
            reasons[type(exc).__name__] = reasons.get(type(exc).__name__, 0) + 1
        finally:
            conn.close()

    start = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(one(k) for k in range(count))), timeout)
    except asyncio.TimeoutError:
        pass
    for why, n in reasons.items():
        print(f"bench: {n} streams failed: {why}", flush=True)
    return ok, count - ok, time.perf_counter() - start
