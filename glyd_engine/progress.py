"""Progress reporting and cancellation shared by every long job (model build, download, pack, table build).

A job takes a `ProgressCallback` and an optional `CancelToken`; the CLI prints the events, the engine logs
them, the app draws them. Events are small and frequent; consumers coalesce them.
"""

from __future__ import annotations

import math
import threading
import time
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
    shows (the app draws no ETA of its own).

    The ETA is remaining work over a smoothed rate (an exponential average of the rate between updates, over
    about `SMOOTH_S` seconds), so it follows a rate that changes (another program taking the cores) without
    jumping with every update; none is given before `MIN_S` seconds and `MIN_FRACTION` of the work, when a
    first estimate would mostly be start-up noise.
    """

    SMOOTH_S = 10.0
    MIN_S = 3.0
    MIN_FRACTION = 0.02

    def __init__(self, job: str, phase: str, total: float | None, callback: ProgressCallback,
                 cancel: CancelToken | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.job, self.phase, self.total = job, phase, total
        self.callback, self.cancel, self.clock = callback, cancel, clock
        self.start = clock()
        self._last: tuple[float, float] | None = None  # (time, done) at the previous update
        self._rate: float | None = None  # smoothed units a second
        self.update(0)

    def eta(self, done: float) -> float | None:
        now = self.clock()
        if self._last is None:
            self._last = (now, done)
        else:
            t0, d0 = self._last
            dt = now - t0
            if done != d0 or dt >= 1.0:  # a step of work, or a second without one (a stall slows the rate)
                if dt > 0 and done >= d0:
                    rate = (done - d0) / dt
                    alpha = 1.0 - math.exp(-dt / self.SMOOTH_S)
                    self._rate = rate if self._rate is None else self._rate + alpha * (rate - self._rate)
                self._last = (now, done)
        if (not self.total or not self._rate or now - self.start < self.MIN_S
                or done < self.MIN_FRACTION * self.total):
            return None
        return max(0.0, (self.total - done) / self._rate)

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
