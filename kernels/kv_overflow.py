"""The CUDA page writer's overflow runs, taken on the device: a decode step's write needs no host sync.

The writer takes a run for a tile's escapes past its list with one atomic add on the arena's top and moves a full run
to one twice the size (kernels/cuda/kv_pages.cu). The host never waits for that top on the common path: it keeps an
upper bound of it — the last snapshot it copied back without waiting, plus the worst case of each write since — and
lets a write run unchecked only when the bound leaves room for that write's worst case. Otherwise (a long prefill,
or the arena filling up) it waits for the top, compacts the live runs into a larger arena when room is short, checks
that write and runs it again for any tile that found no room: rare prompts cost memory and a sync, never data.

CUDA graphs: a replayed write runs no host code, so the step's metadata builder `reserve`s room for it beforehand
(the same bound, counted before the launch), and the kernels read the arena's address and size from `ref` in device
memory, which compaction updates: a graph captured before a compaction reads the new arena.

Worst case of a write of T tokens, H heads and head size D (entries): every new value an escape, every touched run
moved to twice its size: a run holding c entries that takes n tokens' escapes moves to at most 2 (c + n D) + 8
entries, and the c of all touched runs sum to at most the top; a run never takes more than `max_run` entries.
"""

from __future__ import annotations

import torch

from glyd_engine.format.kv_page import OVERFLOW_MIN_RUN, TILE, OverflowStore

HEADROOM_TOKENS = 256  # the arena keeps room for two writes of this many tokens in flight (decode steps of 256
LIVE_HEADROOM = 32  # sequences, one ahead as with async scheduling) beyond this many times its live runs
MAX_UNITS = 1 << 27  # run offsets are 27 bits of 8-entry units in the run pointers


class ArenaFullError(RuntimeError):
    """A write ran without a check and found no room: the bound was wrong (a bug), and those tiles lost escapes."""


class DeviceRuns:
    """One store's device-side run allocation: the counters the writer bumps and the host's bound on them."""

    def __init__(self, store: OverflowStore, head_size: int) -> None:
        self.store = store
        self.head_size = head_size
        device = store.ptr.device
        self.counters = torch.zeros(2, dtype=torch.int32, device=device)  # top (8-entry units), writes with no room
        self.counters[0] = -(-store._top // OVERFLOW_MIN_RUN)
        self.bound = store._top  # entries: an upper bound of the device's top
        self._snapshot = torch.zeros(2, dtype=torch.int32, pin_memory=True)
        self._event: torch.cuda.Event | None = None
        self._since: list[int] = []  # tokens of the writes after the snapshot in flight
        self.need = torch.zeros(0, store.num_heads, 2, dtype=torch.int32, device=device)
        self._old_need: list[torch.Tensor] = []  # captured graphs may still write into these
        self.checked = 0  # writes (or reservations) that waited for the device
        self.reserved = 0  # tokens of the next write, already counted in the bound (`reserve`)
        self.ref = torch.zeros(2, dtype=torch.int64, device=device)  # the arena's address and 8-entry units
        self._ref_of: tuple[int, int] | None = None

    @property
    def capacity(self) -> int:
        return self.store.arena.numel()

    @property
    def max_run(self) -> int:
        """The largest run a tile can need: every value of a kind in its 16 tokens, as a power of two."""
        return 1 << (TILE * self.head_size - 1).bit_length()

    def worst(self, bound: int, tokens: int) -> int:
        """The bound after a write of `tokens` tokens (see the module docstring)."""
        h = self.store.num_heads
        grow = 2 * bound + tokens * h * 2 * (2 * self.head_size + OVERFLOW_MIN_RUN)
        return bound + min(grow, tokens * h * 2 * self.max_run)

    def need_for(self, tokens: int) -> torch.Tensor:
        """The writer's `need` [tokens, H, 2], all zero (the writer zeroes what it marks once a retry succeeds)."""
        if self.need.shape[0] < tokens:
            if self.need.numel():
                self._old_need.append(self.need)
            self.need = torch.zeros(max(tokens, 2 * self.need.shape[0]), self.store.num_heads, 2, dtype=torch.int32,
                                    device=self.counters.device)
        return self.need[:tokens]

    def refresh(self) -> None:
        """Take the snapshot in flight if the device has written it (no waiting)."""
        if self._event is None or not self._event.query():
            return
        top, missed = (int(x) for x in self._snapshot.tolist())
        self._event = None
        _no_misses(missed)
        bound = top * OVERFLOW_MIN_RUN
        for tokens in self._since:
            bound = self.worst(bound, tokens)
        self.bound, self._since = bound, []

    def arena_ref(self) -> torch.Tensor:
        """`ref` [address, units], updated (stream-ordered) when the store's arena has moved since the last call."""
        arena = self.store.arena
        now = (arena.data_ptr(), arena.numel() // OVERFLOW_MIN_RUN)
        if now != self._ref_of:
            if torch.cuda.is_current_stream_capturing():  # the update would be captured with a stale address
                raise RuntimeError("the Glyd overflow arena moved during CUDA-graph capture")
            self.ref[0].fill_(now[0])
            self.ref[1].fill_(now[1])
            self._ref_of = now
        return self.ref

    def reserve(self, tokens: int) -> None:
        """Room for the next write of `tokens` tokens, counted now: the write may then run without host code (a
        graph replay) or consume the reservation (`take_reserved`). Waits for the device only when the arena
        would fill; `tokens` 0 drops a reservation left by a replayed step."""
        self.reserved = 0
        if not tokens:
            return
        self.refresh()
        if self.worst(self.bound, tokens) > self.capacity:
            self.checked += 1
            self.wait()
            self.make_room(tokens)
            if self.worst(self.bound, tokens) > self.capacity:  # longer than the arena's usual headroom
                self.make_room(tokens, extra=self.worst(self.bound, tokens) - self.bound)
        self.arena_ref()
        self.bound = self.worst(self.bound, tokens)
        if self._event is None:  # a snapshot before the write: the write is counted after it
            self._snapshot_now()
            self._since = [tokens]
        else:
            self._since.append(tokens)
        self.reserved = tokens

    def take_reserved(self, tokens: int) -> bool:
        """Whether a write of `tokens` was reserved (counted in the bound); consumes the reservation."""
        ok = 0 < tokens <= self.reserved
        self.reserved = 0
        return ok

    def unchecked_ok(self, tokens: int) -> bool:
        self.refresh()
        return self.worst(self.bound, tokens) <= self.capacity

    def launched_unchecked(self, tokens: int) -> None:
        self.bound = self.worst(self.bound, tokens)
        if self._event is None:  # a snapshot of the counters after this write, read back when it lands
            self._snapshot_now()
        else:
            self._since.append(tokens)

    def _snapshot_now(self) -> None:
        self._snapshot.copy_(self.counters, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self, misses_expected: bool = False) -> tuple[int, int]:
        """The device's top (entries) and the tiles that found no room, waiting for them; misses are expected only
        after a checked write."""
        top, missed = (int(x) for x in self.counters.tolist())
        if not misses_expected:
            _no_misses(missed)
        self._event, self._since = None, []
        self.bound = top * OVERFLOW_MIN_RUN
        return self.bound, missed

    def make_room(self, tokens: int, extra: int = 0) -> None:
        """After `wait`: compact into a larger arena if a write of `tokens` (bounded by HEADROOM_TOKENS) and `extra`
        more entries would not fit. Two writes in flight take the bound from a top t to 9 t + 4 w (w a write's new
        values); the new arena leaves that room (the top is the live runs right after compaction, their moved runs'
        space later)."""
        want = self.worst(self.bound, min(tokens, HEADROOM_TOKENS)) + extra
        if want <= self.capacity and not extra:
            return
        live = int(OverflowStore.unpack(self.store.ptr)[1].sum())
        target = max(self.worst(live, min(tokens, HEADROOM_TOKENS)),
                     LIVE_HEADROOM * live + 4 * self.worst(0, HEADROOM_TOKENS))
        target += extra
        if -(-target // OVERFLOW_MIN_RUN) > MAX_UNITS:
            raise MemoryError(f"the Glyd overflow arena would pass {MAX_UNITS * OVERFLOW_MIN_RUN} entries")
        top = self.store.compact(target)
        self.counters[0] = top // OVERFLOW_MIN_RUN
        self.counters[1] = 0
        self.bound = top
        self.arena_ref()


def _no_misses(missed: int) -> None:
    if missed:
        raise ArenaFullError(f"the Glyd page writer found no overflow room for {missed} runs of unchecked writes; "
                             "their escapes are lost (a bug in the arena's bound: please report it)")


def device_runs(store: OverflowStore, head_size: int) -> DeviceRuns:
    """The store's device-side allocation, made on its first CUDA write."""
    runs = store.device_runs
    if runs is None:
        runs = store.device_runs = DeviceRuns(store, head_size)
    return runs


__all__ = ["ArenaFullError", "DeviceRuns", "device_runs"]
