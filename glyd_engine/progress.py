"""Progress reporting and cancellation shared by every long job (model build, download, pack, table build).

A job takes a `ProgressCallback` and an optional `CancelToken`; the CLI prints the events, the engine logs
them, the app draws them. Events are small and frequent; consumers coalesce them.
"""

from __future__ import annotations

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
    """Turns (done, total) into events with an ETA for one phase of a job."""

    def __init__(self, job: str, phase: str, total: float | None, callback: ProgressCallback,
                 cancel: CancelToken | None = None) -> None:
        self.job, self.phase, self.total = job, phase, total
        self.callback, self.cancel = callback, cancel
        self.start = time.monotonic()
        self.update(0)

    def update(self, done: float, phase: str | None = None) -> None:
        if self.cancel is not None:
            self.cancel.check()
        if phase is not None:
            self.phase = phase
        eta = None
        elapsed = time.monotonic() - self.start
        if self.total and done > 0:
            eta = elapsed * (self.total - done) / done
        self.callback(ProgressEvent(self.job, self.phase, done, self.total, eta))


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
