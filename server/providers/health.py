"""Passive health of deployments: what their answers say about them, no probes.

A deployment is *ejected* (not tried) for a cooldown after `consecutive_failures` failures in a row, or when at least
`min_requests` requests in the last `window_seconds` failed at `failure_rate` or more. When the cooldown is over it
is in *trial*: one request (the first to come) is let through, and its outcome decides: its first content makes it
*healthy* again (on probation: until an answer ends whole, one failure ejects it), failure ejects it again for twice
as long (up to `max_cooldown_seconds`). An upstream 429, 503 or 529 with a
retry-after cools the deployment for exactly that long, after which it is healthy (the upstream said when). Requests
sent before an ejection change nothing when they end, during its cooldown or after it: a burst in flight is one
ejection, not a failed trial each, and only the trial decides (an upstream's later retry-after still lengthens the
cooldown).

Only models with two or more deployments are watched: a model's only deployment is never taken out of service,
since there is nowhere else to send its requests (its retries and fallbacks work as they always did).

The state lives on a `Board`, one slot per watched deployment. `MemoryBoard` serves one process; `FileBoard` is a
small memory-mapped file shared by every worker process of one host (`serve --workers N`, in the run directory),
each change made under an exclusive `flock`, so workers agree on ejections and on who holds the one trial. Hosts
do not share it: each host learns a deployment's health from its own traffic. Times are CLOCK_MONOTONIC
(`time.monotonic`), which all processes of a host share.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

from server.domain_models import HealthSettings

HEALTH_FILE_ENV = "PORTICO_HEALTH_FILE"  # `serve --workers N` tells its workers where the shared board is
HEALTHY, EJECTED, TRIAL = "healthy", "ejected", "trial"
STATES = (HEALTHY, EJECTED, TRIAL)
BUCKETS = 10  # the failure-rate window, in this many slices
TRIAL_TIMEOUT_SECONDS = 60.0  # a trial not decided by then (its process died) lets another request try


class Admission(IntEnum):
    """May a request go to the deployment (false: no), and is it the one trial that decides its return?"""

    REFUSED = 0
    ADMITTED = 1
    TRIAL = 2


@dataclass(slots=True)
class DeploymentHealth:
    ejected_until: float = 0.0
    trial_since: float = 0.0  # a trial request is running since then; 0: none
    ejected_at: float = 0.0  # when it was last ejected after failures: what was sent before says nothing new
    ejections: int = 0  # in a row, each after a failed trial: the cooldown's exponent
    consecutive: int = 0  # failures in a row
    needs_trial: bool = False  # after the cooldown, one request decides
    epochs: list[int] = field(default_factory=lambda: [0] * BUCKETS)  # which slice of time each bucket counts
    requests: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    failures: list[int] = field(default_factory=lambda: [0] * BUCKETS)


def state_of(h: DeploymentHealth, now: float) -> str:
    if now < h.ejected_until:
        return EJECTED
    return TRIAL if h.needs_trial else HEALTHY


def ready_at(h: DeploymentHealth, now: float) -> float:
    """When a request may be sent to it: now, or a later time."""
    if now < h.ejected_until:
        return h.ejected_until
    if h.needs_trial and h.trial_since and now - h.trial_since < TRIAL_TIMEOUT_SECONDS:
        return h.trial_since + TRIAL_TIMEOUT_SECONDS  # someone else's trial decides first
    return now


def cooling(h: DeploymentHealth, now: float) -> bool:
    """Out of service until a trial decides (ejected after failing, or its trial held by another request): a retry
    does not wait for it. One cooled by the upstream's retry-after comes back when it said, as a retry's wait does."""
    return h.needs_trial and ready_at(h, now) > now


def acquire(h: DeploymentHealth, now: float) -> Admission:
    """May this request go to it? Claims the trial when one is due."""
    if ready_at(h, now) > now:
        return Admission.REFUSED
    if h.needs_trial:
        h.trial_since = now
        return Admission.TRIAL
    return Admission.ADMITTED


def answering(h: DeploymentHealth, now: float, s: HealthSettings) -> None:
    """The trial's answer has begun well (its first content came): the deployment takes requests again at once,
    not only once that answer ends (a long stream held every other request off for up to TRIAL_TIMEOUT_SECONDS, a
    model whose deployments were all in trial answered them 503). Until an answer ends whole, one failure (the
    trial's own included) ejects it again, for twice as long: that is still its trial failing."""
    if h.needs_trial and h.trial_since and now >= h.ejected_until:
        h.needs_trial, h.trial_since = False, 0.0
        h.consecutive = max(h.consecutive, s.consecutive_failures - 1)


def succeeded(h: DeploymentHealth, now: float, s: HealthSettings, sent: float | None = None) -> None:
    """`sent`: when its request was sent (None: not known, judged by `now` alone)."""
    if _sent_before_ejection(h, now, sent):  # its trial decides, after the cooldown
        return
    _count(h, now, s, failed=False)
    h.consecutive, h.ejections = 0, 0  # a whole answer: the next ejection starts from the configured cooldown
    if h.needs_trial:
        h.needs_trial, h.trial_since = False, 0.0


def failed(h: DeploymentHealth, now: float, s: HealthSettings, retry_after: float = 0.0,
           sent: float | None = None) -> None:
    """A failure that says something about the deployment (not the caller's mistake). `retry_after`: the upstream
    asked for that many seconds (a 429, 503 or 529 with retry-after). `sent`: when its request was sent (None: not
    known, judged by `now` alone)."""
    if _sent_before_ejection(h, now, sent):
        # Nothing new but a later return the upstream may ask for, and no failed trial (each one of a burst in flight
        # doubled the cooldown: ten of them made 5 s the 300 s maximum); a trial still decides.
        h.ejected_until = max(h.ejected_until, now + retry_after)
        return
    _count(h, now, s, failed=True)
    h.consecutive += 1
    if retry_after > 0:  # the upstream said when: exactly that long, no trial after it (a trial it answered included)
        h.ejected_until = max(h.ejected_until, now + retry_after)
        h.consecutive, h.needs_trial, h.trial_since, h.ejections = 0, False, 0.0, 0
    elif h.needs_trial:
        _eject(h, now, s)
    elif h.consecutive >= s.consecutive_failures or _rate_exceeded(h, now, s):
        _eject(h, now, s)


def _sent_before_ejection(h: DeploymentHealth, now: float, sent: float | None) -> bool:
    """An outcome of a request sent before the last ejection after failures, which says nothing the ejection did not,
    and is no trial: also one that ends after the cooldown (a slow upstream's timeout), which doubled the cooldown
    as a failed trial though nothing had been sent to the deployment since. An outcome during the cooldown is one
    (none is sent to it meanwhile)."""
    return (sent is not None and sent < h.ejected_at) or (h.needs_trial and now < h.ejected_until)


def released(h: DeploymentHealth) -> None:
    """A request ended saying nothing about the deployment (the caller left, or its request was refused as wrong):
    a trial it held is free for the next request."""
    h.trial_since = 0.0


def _eject(h: DeploymentHealth, now: float, s: HealthSettings) -> None:
    cooldown = min(s.max_cooldown_seconds, s.cooldown_seconds * 2 ** min(h.ejections, 30))
    h.ejected_until = max(h.ejected_until, now + cooldown)  # never sooner than an upstream's retry-after said
    h.ejections += 1
    h.ejected_at = now
    h.needs_trial, h.trial_since, h.consecutive = True, 0.0, 0
    h.epochs, h.requests, h.failures = [0] * BUCKETS, [0] * BUCKETS, [0] * BUCKETS  # judged afresh after it


def _count(h: DeploymentHealth, now: float, s: HealthSettings, *, failed: bool) -> None:
    epoch = int(now / (s.window_seconds / BUCKETS)) + 1  # + 1: epoch 0 marks an unused bucket
    i = epoch % BUCKETS
    if h.epochs[i] != epoch:
        h.epochs[i], h.requests[i], h.failures[i] = epoch, 0, 0
    h.requests[i] += 1
    h.failures[i] += failed


def _rate_exceeded(h: DeploymentHealth, now: float, s: HealthSettings) -> bool:
    oldest = int(now / (s.window_seconds / BUCKETS)) + 1 - BUCKETS
    live = [i for i in range(BUCKETS) if h.epochs[i] > oldest]
    requests = sum(h.requests[i] for i in live)
    return requests >= s.min_requests and sum(h.failures[i] for i in live) >= s.failure_rate * requests


Watched = tuple[str, str, HealthSettings]  # model id, deployment name, the model's health settings


class Board:
    """The health of every watched deployment, by slot. Subclasses say where the values live (`_change`)."""

    def __init__(self, watched: Sequence[Watched], clock: Callable[[], float] = time.monotonic) -> None:
        self._names = tuple((model, deployment) for model, deployment, _ in watched)
        self._settings = tuple(settings for _, _, settings in watched)
        self.clock = clock

    def __len__(self) -> int:
        return len(self._settings)

    @contextmanager
    def _change(self, slot: int):  # yields the slot's DeploymentHealth; changes to it are kept
        raise NotImplementedError

    def ready_in(self, slot: int) -> float:
        """Seconds until a request may be sent to it (0: now)."""
        now = self.clock()
        with self._change(slot) as h:
            return max(0.0, ready_at(h, now) - now)

    def cooling(self, slot: int) -> bool:
        with self._change(slot) as h:
            return cooling(h, self.clock())

    def acquire(self, slot: int) -> Admission:
        with self._change(slot) as h:
            return acquire(h, self.clock())

    def answering(self, slot: int) -> None:
        with self._change(slot) as h:
            answering(h, self.clock(), self._settings[slot])

    def succeeded(self, slot: int, sent: float | None = None) -> None:
        with self._change(slot) as h:
            succeeded(h, self.clock(), self._settings[slot], sent)

    def failed(self, slot: int, retry_after: float = 0.0, sent: float | None = None) -> None:
        with self._change(slot) as h:
            failed(h, self.clock(), self._settings[slot], retry_after, sent)

    def released(self, slot: int) -> None:
        with self._change(slot) as h:
            released(h)

    def states(self) -> list[tuple[str, str, str]]:
        """(model id, deployment name, state) of every watched deployment."""
        now = self.clock()
        states = []
        for slot, (model, deployment) in enumerate(self._names):
            with self._change(slot) as h:
                states.append((model, deployment, state_of(h, now)))
        return states

    def close(self) -> None:
        pass


class MemoryBoard(Board):
    def __init__(self, watched: Sequence[Watched], clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(watched, clock)
        self._slots = [DeploymentHealth() for _ in watched]

    @contextmanager
    def _change(self, slot: int):
        yield self._slots[slot]


_HEAD = struct.Struct("<ddd3q")  # ejected_until, trial_since, ejected_at, ejections, consecutive, needs_trial
_BUCKET = struct.Struct("<qii")  # epoch, requests, failures
_SLOT = _HEAD.size + BUCKETS * _BUCKET.size


class FileBoard(Board):
    """The same values in a file every worker process of the host maps; all zeros is a healthy deployment, so a new
    file (or a deployment added at a restart) starts healthy."""

    def __init__(self, path: Path, watched: Sequence[Watched],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(watched, clock)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = max(1, len(watched)) * _SLOT
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            # Its blocks taken now (not a sparse ftruncate): a page first written once TMPDIR has filled would kill
            # the worker writing it with SIGBUS. A full TMPDIR is an OSError here, at start, instead.
            os.posix_fallocate(self._fd, 0, size)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._map = mmap.mmap(self._fd, size)

    @contextmanager
    def _change(self, slot: int):
        offset = slot * _SLOT
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            h = _load(self._map, offset)
            yield h
            _store(self._map, offset, h)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


def _load(buffer: mmap.mmap, offset: int) -> DeploymentHealth:
    ejected_until, trial_since, ejected_at, ejections, consecutive, needs_trial = _HEAD.unpack_from(buffer, offset)
    h = DeploymentHealth(ejected_until, trial_since, ejected_at, ejections, consecutive, bool(needs_trial))
    for i in range(BUCKETS):
        h.epochs[i], h.requests[i], h.failures[i] = _BUCKET.unpack_from(buffer, offset + _HEAD.size + i * _BUCKET.size)
    return h


def _store(buffer: mmap.mmap, offset: int, h: DeploymentHealth) -> None:
    _HEAD.pack_into(buffer, offset, h.ejected_until, h.trial_since, h.ejected_at, h.ejections, h.consecutive,
                    int(h.needs_trial))
    for i in range(BUCKETS):
        _BUCKET.pack_into(buffer, offset + _HEAD.size + i * _BUCKET.size, h.epochs[i], h.requests[i], h.failures[i])
