"""One pipelined connection to Redis, shared by every rate-limit call of a process.

redis-py's pooled client spends more CPU on a command than Redis spends running our scripts: a connection borrowed
from the pool and given back, a write (and a task for its timeout) and a read per command, retry and instrumentation
wrappers. Here every command goes out on one connection: those issued in one turn of the event loop leave in one
write, replies come back in the order the commands were sent (Redis answers each connection in order) and hiredis
parses them in C as soon as the event loop reads them. redis-py still opens the connection (URL options, TLS, AUTH,
SELECT), then hands its transport over. With `python -m bench --workers 2` (a local Redis, 2 cores) this, with the
Limiter's cheaper paths, took the gateway from ~2.6 to ~1.9 ms of CPU per request (~650 -> ~800-900 req/s).

Failures mean what they meant with redis-py's client, which the store relies on:
    ConnectionError  the connection broke (refused, reset, closed by Redis). A command is retried once on a new
                     connection: after a Redis restart the old connection fails at its first use.
    TimeoutError     no reply within the timeout: the connection is closed, and every command waiting on it fails
                     the same way. Never retried: the command may have run. Until Redis answers again, of the
                     commands a caller waits on one a second tries it (Silence), the others fail so at once, unsent.
    ResponseError    Redis refused the command (NoScriptError: a script it does not have cached; Refusing: it cannot
                     serve now, e.g. a replica after a failover or NOAUTH, an outage to the store rather than a bug).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection, Connection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = str | bytes | int | float
_STALL = 0.05  # seconds: a timer that fires later than this was held up by the event loop, not by Redis
# How often a Redis that stopped answering is tried again: as often as readiness asks, so it notices the end of an
# outage as soon as that does, and every other command meanwhile is answered at once instead of at its timeout.
_TRIAL_SECONDS = 1.0


# Error replies of a Redis that cannot serve commands now, whatever they are: loading its data, a read-only replica, no
# master, busy with a script, out of memory, unable to persist (a script that hits one stops at that write), a
# password it requires and the URL does not give, or an ACL user not allowed our commands (NOAUTH, NOPERM: the
# limits cannot be counted until the operator fixes one or the other, an outage rather than a bug).
_REFUSING = frozenset({"LOADING", "READONLY", "MASTERDOWN", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "OOM", "MISCONF",
                       "NOAUTH", "NOPERM"})


class Refusing(ResponseError):
    """Redis answered that it cannot run commands now: for its callers an outage, like a Redis that does not answer."""


@dataclass(slots=True)
class Dispatch:
    """Whether a command was handed to a connection: from then on Redis may run it, even if no answer comes back."""

    sent: bool = False


class Script:
    """A Lua script, run by its SHA1 (EVALSHA) once Redis has it cached."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


def pack(args: Sequence[Arg]) -> bytes:
    """A command in RESP, arguments encoded as redis-py encodes them (numbers by their repr)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        kind = type(arg)
        if kind is str:
            data = arg.encode()
        elif kind is bytes:
            data = arg
        elif kind is int or kind is float:
            data = repr(arg).encode()
        else:
            raise TypeError(f"cannot send a {kind.__name__} to Redis")
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


class _Link(asyncio.Protocol):
    """One open connection: commands out in order, replies matched to them in order as they arrive."""

    def __init__(self, connection: AbstractConnection, timeout: float, silence: Silence) -> None:
        # redis-py opened the connection and read the replies to its handshake; its transport is ours from here on
        # (the connection object is kept only to close it: dropped, it would close the transport itself).
        self._connection = connection
        self._where = connection._host_error()
        self._transport: asyncio.Transport = connection._writer.transport
        self._timeout = timeout
        self._silence = silence
        self._loop = asyncio.get_running_loop()
        self._parser = hiredis.Reader(replyError=ResponseError)
        self._waiting: deque[tuple[asyncio.Future, float]] = deque()  # (reply, when it was asked for), oldest first
        self._outbox: list[bytes] = []  # commands of this turn of the event loop, written together at its end
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_due = 0.0
        self._lost = self._loop.create_future()
        self.error: Exception | None = None  # set once the link is unusable
        self._transport.set_protocol(self)

    def send(self, command: bytes) -> asyncio.Future:
        """The future reply to a packed command. Cancelling the future does not unsend the command: its reply is
        read and dropped."""
        if self.error is not None:
            raise type(self.error)(str(self.error))
        reply = self._loop.create_future()
        self._waiting.append((reply, self._loop.time()))
        if self._watchdog is None:
            self._watch(self._timeout)
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(command)
        return reply

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        if self.error is None and outbox:
            try:
                self._transport.write(b"".join(outbox))
            except Exception as exc:  # noqa: BLE001 (a transport that is closing: RuntimeError, OSError)
                self.fail(RedisConnectionError(f"Error while writing to {self._where}: {exc!r}"))

    def data_received(self, data: bytes) -> None:
        """Replies are handed over here, as soon as the event loop reads them."""
        try:
            self._parser.feed(data)
            while (reply := self._parser.gets()) is not False:
                self._silence.silent = False
                if not self._waiting:
                    raise RedisConnectionError(f"{self._where} answered a command that was not sent")
                future = self._waiting.popleft()[0]
                if future.done():  # its caller gave up waiting
                    continue
                if isinstance(reply, ResponseError):
                    future.set_exception(_error(reply))
                else:
                    future.set_result(reply)
        except Exception as exc:  # noqa: BLE001 (hiredis.ProtocolError, ...: the connection is unusable)
            self.fail(exc if isinstance(exc, RedisConnectionError) else
                      RedisConnectionError(f"Error while reading from {self._where}: {exc!r}"))

    def eof_received(self) -> bool:
        self.fail(RedisConnectionError(f"Connection closed by {self._where}."))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"Connection to {self._where} lost: {exc!r}" if exc else
                                       f"Connection to {self._where} closed."))
        if not self._lost.done():
            self._lost.set_result(None)

    def _watch(self, delay: float) -> None:
        self._watchdog_due = self._loop.time() + delay
        self._watchdog = self._loop.call_later(delay, self._check)

    def _check(self) -> None:
        """The oldest command must be answered within the timeout (Redis answers a connection in order, so the
        others wait on it); if not, the connection is closed and every command waiting on it fails."""
        self._watchdog = None
        if self.error is not None or not self._waiting:
            return
        now = self._loop.time()
        if now - self._watchdog_due > _STALL:
            # This check comes late: the event loop itself was held up (a busy or starved process), and replies
            # may be waiting in the socket. Judge after the loop has had a chance to read them.
            self._watch(_STALL)
            return
        left = self._waiting[0][1] + self._timeout - now
        if left > 0:
            self._watch(left)
        else:
            self._silence.timed_out()
            self.fail(RedisTimeoutError(f"Timeout reading from {self._where}"))

    def fail(self, error: Exception) -> None:
        """Close the connection; every command still waiting fails with (a copy of) the error."""
        if self.error is not None:
            return
        self.error = error
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._outbox = []
        self._connection._close()  # closes the transport
        while self._waiting:
            future = self._waiting.popleft()[0]
            if not future.done():
                future.set_exception(type(error)(str(error)))

    async def close(self) -> None:
        self.fail(RedisConnectionError("Connection closed."))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._timeout):
                await asyncio.shield(self._lost)


def _error(reply: ResponseError) -> ResponseError:
    message = str(reply)
    code = message.split(" ", 1)[0]
    if code == "NOSCRIPT":
        return NoScriptError(message)
    if message.startswith("ERR Protocol error: unauthenticated"):  # a script's many arguments, sent without AUTH
        return Refusing(f"NOAUTH {message}")
    if message.startswith("ERR The user executing the script can't run"):  # Redis 7.0's NOPERM inside a script
        return Refusing(f"NOPERM {message}")
    return Refusing(message) if code in _REFUSING else reply


def _retrieve(attempt: asyncio.Task) -> None:
    """An attempt's failure is read here too: every caller may have given up waiting on it."""
    if not attempt.cancelled():
        attempt.exception()


class Silence:
    """A Redis that stopped answering (frozen, a host gone without a reset, a network cut) takes connections, or
    seems to, and answers nothing: every command a caller waits on (an admission, a cache lookup) waited out its
    timeout, one after another, for the whole outage, fail-open or not. After a timeout, one such command a second
    goes to Redis as a trial and the others fail at once, unsent, as it did; any answer ends the outage. Commands
    nobody waits on (settlements, renewals, readiness's write) are always sent: a timeout costs them nothing."""

    def __init__(self) -> None:
        self.silent = False  # the last reply awaited did not come in time, and none has come since
        self._next_trial = 0.0

    def admit(self) -> None:
        """Raises for a command a caller waits on while Redis is silent, but one a second."""
        if self.silent:
            now = time.monotonic()
            if now < self._next_trial:
                raise RedisTimeoutError("Redis did not answer lately: it is tried again once a second until it does")
            self._next_trial = now + _TRIAL_SECONDS

    def timed_out(self) -> None:
        self.silent, self._next_trial = True, time.monotonic() + _TRIAL_SECONDS


class RedisPipe:
    """Commands to one Redis over one pipelined connection, opened at first use and again after it broke."""

    def __init__(self, url: str, *, timeout: float) -> None:
        """`timeout`: to connect, and for each reply. Options in the URL's query string take precedence, as with
        redis-py's from_url."""
        options: dict[str, Any] = {
            "socket_timeout": timeout, "socket_connect_timeout": timeout, **parse_url(url),
            "retry": Retry(NoBackoff(), 0),  # retried here, per command, instead
            "protocol": 2,  # RESP2: no push messages in between replies
        }
        self._connection_class: type[AbstractConnection] = options.pop("connection_class", Connection)
        self._options = options
        self._timeout = options["socket_timeout"] or timeout
        self._link: _Link | None = None
        self._opening: asyncio.Task[_Link] | None = None  # the attempt to connect under way, if any
        self.connections = 0  # opened so far: a new one may be to a Redis that restarted (without its data)
        self._silence = Silence()

    async def execute(self, *args: Arg, dispatch: Dispatch | None = None, waited_on: bool = False) -> Any:
        """`waited_on`: a caller waits for the reply, so while Redis is silent it fails at once (Silence)."""
        command = pack(args)
        try:
            return await self._send(command, dispatch, waited_on)
        except RedisConnectionError:
            return await self._send(command, dispatch)  # on a new connection: the old one may have gone stale

    async def execute_many(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Several commands, sent together (not a transaction); raises the first one's error, if any."""
        packed = [pack(command) for command in commands]
        try:
            return await self._send_many(packed)
        except RedisConnectionError:
            return await self._send_many(packed)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg],
                  dispatch: Dispatch | None = None, waited_on: bool = False) -> Any:
        """`dispatch`, if given, is marked sent once the command is on a connection (see Dispatch)."""
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args, dispatch=dispatch,
                                      waited_on=waited_on)
        except NoScriptError:  # a Redis restarted or flushed its script cache: EVAL caches it again
            return await self.execute("EVAL", script.text, len(keys), *keys, *args, dispatch=dispatch)

    async def _send(self, command: bytes, dispatch: Dispatch | None = None, waited_on: bool = False) -> Any:
        if waited_on:
            self._silence.admit()
        link = self._link
        if link is None or link.error is not None:
            link = await self._connect()
        reply = link.send(command)
        if dispatch is not None:
            dispatch.sent = True
        return await reply

    async def _send_many(self, commands: list[bytes]) -> list[Any]:
        link = self._link
        if link is None or link.error is not None:
            link = await self._connect()
        replies = await asyncio.gather(*[link.send(command) for command in commands], return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return replies

    async def _connect(self) -> _Link:
        """Callers that find no connection share one attempt to make it, run as a task of its own: a caller whose
        own timeout ends gives up waiting without cancelling the attempt under the others. (Under a lock, each
        caller made the attempt in turn, and one that took the lock as the previous holder gave up began another
        from scratch: on Python 3.11 its timeout could then fire unheard, and a cache lookup that should have cost
        one timeout while Redis did not answer cost two.)"""
        if self._link is not None and self._link.error is None:
            return self._link
        if self._opening is None or self._opening.done():
            self._opening = asyncio.create_task(self._open())
            self._opening.add_done_callback(_retrieve)
        return await asyncio.shield(self._opening)

    async def _open(self) -> _Link:
        """Connect and handshake, each bounded by redis-py's own timeouts."""
        connection = self._connection_class(**self._options)
        try:
            await connection.connect()
        except BaseException as exc:
            if isinstance(exc, RedisTimeoutError):  # took the connection (the kernel does) but said nothing
                self._silence.timed_out()
            connection._close()  # cancelled during the handshake, say: do not leak the socket
            raise
        self._link = _Link(connection, self._timeout, self._silence)
        self.connections += 1
        return self._link

    async def close(self) -> None:
        """Close the connection (a later command opens a new one)."""
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
            await asyncio.wait([self._opening])  # its end, whatever it was: a failure is _retrieve's to read
        if self._link is not None:
            await self._link.close()
            self._link = None
