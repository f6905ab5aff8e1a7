"""Progress reporting and cancellation shared by every long job (model build, download, pack, table build).

A job takes a `ProgressCallback` and an optional `CancelToken`; the CLI prints the events, the engine logs
them, the app draws them. Events are small and frequent; consumers coalesce them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class Cancelled(Exception):
    """Raised inside a job when its CancelToken was set; the job leaves nothing half-written."""


@dataclass(frozen=True)
class ProgressEvent:
    job: str  # e.g. "kv-tables", "demo-model", "pack"
    phase: str  # human text for the current step
    done: float  # units done in this phase
    total: float | None  # None when unknown
    eta_s: float | None = None

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return min(1.0, max(0.0, self.done / self.total))


ProgressCallback = Callable[[ProgressEvent], None]


def no_progress(_: ProgressEvent) -> None:
    return None


class CancelToken:
    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled("cancelled")


class PhaseTimer:
    """Turns (done, total) into events with an ETA for one phase of a job: the one estimate every front end
    shows (the app draws no ETA of its own, it only counts this one down between events).

    The ETA is the remaining work over the rate measured across the last `WINDOW_S` seconds of progress,
    counted from the first finished unit (the first one carries the phase's warm-up) up to now (so a stall
    lengthens it). Units of uneven cost (a table build's calibration runs, 1-11 s each on shared cores)
    average out over the window instead of swinging the estimate with every unit, as a rate smoothed over a
    few seconds did (1 to 8 minutes for a 165 s build); a lasting change of speed still shows within the
    window. None is given before `MIN_S` seconds, `MIN_FRACTION` of the work and `MIN_POINTS` steps of work.
    """

    WINDOW_S = 90.0
    MIN_POINTS = 4  # the first finished unit and three more: fewer give a rate of one or two uneven units
    MIN_S = 3.0
    MIN_FRACTION = 0.02

    def __init__(self, job: str, phase: str, total: float | None, callback: ProgressCallback,
                 cancel: CancelToken | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.job, self.phase, self.total = job, phase, total
        self.callback, self.cancel, self.clock = callback, cancel, clock
        self.start = clock()
        self._points: deque[tuple[float, float]] = deque()  # (time, done) at each step of work since the first
        self.update(0)

    def eta(self, done: float) -> float | None:
        now = self.clock()
        points = self._points
        if done > 0 and (not points or done > points[-1][1]):
            points.append((now, done))
        while len(points) > 2 and now - points[1][0] >= self.WINDOW_S:
            points.popleft()  # keep one point at or beyond the window's start
        if (not self.total or len(points) < self.MIN_POINTS or now - self.start < self.MIN_S
                or done < self.MIN_FRACTION * self.total):
            return None
        t0, d0 = points[0]
        rate = (points[-1][1] - d0) / max(now - t0, 1e-9)
        return max(0.0, (self.total - done) / rate) if rate > 0 else None

    def update(self, done: float, phase: str | None = None) -> None:
        if self.cancel is not None:
            self.cancel.check()
        if phase is not None:
            self.phase = phase
        self.callback(ProgressEvent(self.job, self.phase, done, self.total, self.eta(done)))


def print_progress(event: ProgressEvent) -> None:
    """A one-line terminal renderer for the CLI (stderr, carriage-return updates)."""
    import sys

    frac = event.fraction
    pct = f"{frac * 100:5.1f}%" if frac is not None else "  ...  "
    eta = f" ETA {event.eta_s:5.0f}s" if event.eta_s is not None else ""
    sys.stderr.write(f"\r[{event.job}] {event.phase[:50]:<50} {pct}{eta}   ")
    if frac is not None and frac >= 1.0:
        sys.stderr.write("\n")
    sys.stderr.flush()
