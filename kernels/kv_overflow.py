"""The CUDA page writer's overflow runs, taken on the device: a decode step's write needs no host sync.

The writer takes a run for a tile's escapes past its list with one atomic add on the arena's top and moves a full run
to one twice the size (kernels/cuda/kv_pages.cu). The host never waits for that top on the common path: it keeps an
upper bound of it — the last snapshot it copied back without waiting (one copy of every store's counters on the
device, `CounterBank`), plus the worst case of each write since — and lets a write run unchecked only when the bound
leaves room for that write's worst case. Otherwise (a long prefill, or the arena filling up) it waits for the top,
compacts the live runs into a larger arena when room is short, checks that write and runs it again for any tile
that found no room: rare prompts cost memory and a sync, never data.

CUDA graphs: a replayed write runs no host code, so the step's metadata builder `reserve`s room for it beforehand
(the same bound, counted before the launch), and the kernels read the arena's address and size from `ref` in device
memory, which compaction updates: a graph captured before a compaction reads the new arena.

Worst case of a write of T tokens, H heads and head size D (entries): every new value an escape, every touched run
moved to twice its size: a run holding c entries that takes n tokens' escapes moves to at most 2 (c + n D) + 8
entries, and the c of all touched runs sum to at most the top; a run never takes more than `max_run` entries.
"""

from __future__ import annotations

import logging
import weakref

import torch

from glyd_engine.format.kv_page import OVERFLOW_MIN_RUN, TILE, OverflowRoomError, OverflowStore, whole_runs

HEADROOM_TOKENS = 256  # the arena keeps room for two writes of this many tokens in flight (decode steps of 256
LIVE_HEADROOM = 32  # sequences, one ahead as with async scheduling) beyond this many times its live runs
MAX_UNITS = 1 << 27  # run offsets are 27 bits of 8-entry units in the run pointers
BANK_SLOTS = 4096  # overflow stores (attention layers) one device's counter bank holds

log = logging.getLogger("vllm.glyd.kernels")


def worst_after(bound: int, tokens: int, num_heads: int, head_size: int) -> int:
    """The bound (entries) after a write of `tokens` tokens (see the module docstring)."""
    grow = 2 * bound + tokens * num_heads * 2 * (2 * head_size + OVERFLOW_MIN_RUN)
    return bound + min(grow, tokens * num_heads * 2 * max_run(head_size))


def max_run(head_size: int) -> int:
    """The largest run a tile can need: every value of a kind in its 16 tokens, as a power of two."""
    return 1 << (TILE * head_size - 1).bit_length()


def arena_target(live: int, tokens: int, num_heads: int, head_size: int) -> int:
    """The entries a compaction leaves the arena with `live` entries in runs before a write of `tokens` tokens
    (bounded by HEADROOM_TOKENS). Two writes in flight take the bound from a top t to 9 t + 4 w (w a write's new
    values); the new arena leaves that room (the top is the live runs right after compaction, their moved runs'
    space later)."""
    tokens = min(tokens, HEADROOM_TOKENS)
    return max(worst_after(live, tokens, num_heads, head_size),
               LIVE_HEADROOM * live + 4 * worst_after(0, HEADROOM_TOKENS, num_heads, head_size))


def fresh_entries(num_heads: int, head_size: int) -> int:
    """Entries of an arena with no live runs. An engine takes this much a layer before vLLM profiles memory
    (`reserve_arena`), so vLLM's KV budget counts it; only rare values make an arena grow past it."""
    return arena_target(0, HEADROOM_TOKENS, num_heads, head_size)


def reserve_arena(num_heads: int, head_size: int, device: torch.device, limit: int | None = None) -> torch.Tensor:
    """A layer's first arena, allocated now: taken while vLLM loads the model, it is held before vLLM's memory
    profile, which gives the KV cache only what is left (the store adopts it when the cache is bound). An arena limit
    (entries) smaller than the usual first arena is the first arena: the limit holds from the first write."""
    entries = fresh_entries(num_heads, head_size)
    if limit is not None:
        entries = min(entries, max(OVERFLOW_MIN_RUN, whole_runs(limit)))
    return torch.zeros(entries, dtype=torch.int16, device=device)


def pointer_entries_bound(kv_budget_bytes: int, layers: int, token_bytes: int) -> int:
    """The most run pointers (int32) one layer can need when vLLM shares `kv_budget_bytes` among `layers` layers of
    pages of `token_bytes` (C) a token and KV head: a block of B tokens and H heads takes B H C bytes a layer and
    holds B/16 tiles x H heads x 2 (K, V) pointers, so the blocks a budget buys hold budget / (8 L C) pointers a
    layer, whatever B and H."""
    return -(-kv_budget_bytes // (8 * max(1, layers) * token_bytes))


def reserve_pointers(entries: int, device: torch.device) -> torch.Tensor:
    """Memory for a layer's run pointers, taken while vLLM loads the model (as `reserve_arena`): vLLM's memory
    profile counts it, and the store takes its pointer table from it once vLLM has sized the cache."""
    return torch.empty(entries, dtype=torch.int32, device=device)


class ArenaFullError(RuntimeError):
    """A write ran without a check and found no room: the bound was wrong (a bug), and those tiles lost escapes."""


class CounterBank:
    """The writer counters of every store on one device in one tensor, so that one copy snapshots them all: a step
    of 36 layers takes one copy and one event, not 36 (each a stall between kernels on the stream)."""

    def __init__(self, device: torch.device) -> None:
        self.counters = torch.zeros(BANK_SLOTS, 2, dtype=torch.int32, device=device)
        self.mirror = torch.zeros(BANK_SLOTS, 2, dtype=torch.int32, pin_memory=True)
        self.stores: list[weakref.ref[DeviceRuns] | None] = []
        self.event: torch.cuda.Event | None = None
        self.epoch = 0  # the snapshot in flight (or the last one)
        self.landed: list[list[int]] = []  # the last snapshot that landed: [top, missed] a slot
        self.landed_epoch = 0

    def add(self, runs: DeviceRuns) -> int:
        """A free slot for `runs` (a dead store's slot is reused; its graphs died with its layer)."""
        for i, ref in enumerate(self.stores):
            if ref is None or ref() is None:
                self.stores[i] = weakref.ref(runs)
                return i
        if len(self.stores) == BANK_SLOTS:
            raise RuntimeError(f"more than {BANK_SLOTS} Glyd overflow stores on one device")
        self.stores.append(weakref.ref(runs))
        return len(self.stores) - 1

    def snapshot(self) -> int:
        """Copy every slot's counters back (non-blocking) unless a copy is in flight; the epoch in flight. A store
        with a reserved write not yet launched counts it after this copy (it runs after it)."""
        if self.event is None:
            n = len(self.stores)
            self.mirror[:n].copy_(self.counters[:n], non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            self.epoch += 1
            for ref in self.stores:
                runs = ref() if ref is not None else None
                if runs is not None and runs.reserved:
                    runs.apply_landed()  # the landed copy first, with the writes counted against it
                    runs._epoch, runs._since = self.epoch, [runs.reserved]
        return self.epoch

    def land(self) -> None:
        """If the copy in flight has landed, keep its values: each store takes its own at its next refresh."""
        if self.event is None or not self.event.query():
            return
        self.event = None
        self.landed = self.mirror[: len(self.stores)].tolist()
        self.landed_epoch = self.epoch


_BANKS: dict[int, CounterBank] = {}


def _bank(device: torch.device) -> CounterBank:
    index = device.index if device.index is not None else torch.cuda.current_device()
    bank = _BANKS.get(index)
    if bank is None:
        bank = _BANKS[index] = CounterBank(torch.device("cuda", index))
    return bank


class DeviceRuns:
    """One store's device-side run allocation: the counters the writer bumps and the host's bound on them."""

    def __init__(self, store: OverflowStore, head_size: int) -> None:
        self.store = store
        self.head_size = head_size
        device = store.ptr.device
        self.bank = _bank(device)
        self.slot = self.bank.add(self)
        self.counters = self.bank.counters[self.slot]  # top (8-entry units), writes with no room
        self.counters[0] = -(-store._top // OVERFLOW_MIN_RUN)
        self.counters[1] = 0
        self.bound = store._top  # entries: an upper bound of the device's top
        self._first_epoch = self.bank.epoch + 1  # snapshots issued before this store's slot was set say nothing of it
        self._applied = 0  # the last landed snapshot this store took
        self._epoch = 0  # the bank's snapshot that `_since` counts from (0: none)
        self._since: list[int] = []  # tokens of this store's writes after that snapshot
        self.need = torch.zeros(0, store.num_heads, 2, dtype=torch.int32, device=device)
        self._old_need: list[torch.Tensor] = []  # captured graphs may still write into these
        self.checked = 0  # writes (or reservations) that waited for the device
        self.reserved = 0  # tokens of the next write, already counted in the bound (`reserve`)
        self.ref = torch.zeros(2, dtype=torch.int64, device=device)  # the arena's address and 8-entry units
        self._ref_of: tuple[int, int] | None = None

    @property
    def capacity(self) -> int:
        return self.store.arena.numel()

    def worst(self, bound: int, tokens: int) -> int:
        """The bound after a write of `tokens` tokens (see the module docstring)."""
        return worst_after(bound, tokens, self.store.num_heads, self.head_size)

    def need_for(self, tokens: int) -> torch.Tensor:
        """The writer's `need` [tokens, H, 2], all zero (the writer zeroes what it marks once a retry succeeds)."""
        if self.need.shape[0] < tokens:
            if self.need.numel():
                self._old_need.append(self.need)
            self.need = torch.zeros(max(tokens, 2 * self.need.shape[0]), self.store.num_heads, 2, dtype=torch.int32,
                                    device=self.counters.device)
        return self.need[:tokens]

    def refresh(self) -> None:
        """Take the bank's last landed snapshot, landing the one in flight if the device has written it (no
        waiting). Every count of a write refreshes first, so a snapshot is never taken after a later write.

        A snapshot taken at point P of the stream gives the top then, plus the worst case of this store's writes
        after P: those in `_since` when it counts from P; none when it counts from an older snapshot or from none
        (a write after P's issue counts from P)."""
        self.bank.land()
        self.apply_landed()

    def apply_landed(self) -> None:
        """The bank's last landed copy into this store's bound (once), without landing the one in flight."""
        bank = self.bank
        epoch = bank.landed_epoch
        if epoch <= self._applied:
            return
        self._applied = epoch
        if epoch < self._first_epoch or self.slot >= len(bank.landed):  # another (dead) store's values, or zeros
            if self._epoch and self._epoch <= epoch:
                self._epoch, self._since = 0, []
            return
        top, missed = bank.landed[self.slot]
        _no_misses(missed)
        bound = top * OVERFLOW_MIN_RUN
        if self._epoch == epoch:
            for tokens in self._since:
                bound = self.worst(bound, tokens)
        elif self._epoch > epoch:  # counts from a newer snapshot in flight: keep waiting for that one
            return
        self._epoch, self._since = 0, []
        self.bound = min(self.bound, bound)

    def _count(self, tokens: int, launched: bool) -> None:
        """Add a write to the bound, and to the writes after the bank's snapshot in flight. With none in flight, one
        is taken only when two more such writes would not fit (the write, if already launched, is before it): while
        room is ample the bound needs no tightening, and each snapshot costs a copy on the stream."""
        self.bound = self.worst(self.bound, tokens)
        if self.bank.event is None:
            if self.worst(self.worst(self.bound, tokens), tokens) <= self.capacity:
                self._epoch, self._since = 0, []  # a later snapshot is taken after this write
                return
            self._epoch = self.bank.snapshot()
            self._since = [] if launched else [tokens]
            return
        if self._epoch != self.bank.epoch:  # this store's earlier writes were all before that snapshot
            self._epoch, self._since = self.bank.epoch, []
        self._since.append(tokens)

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
        would fill; `tokens` 0 drops a reservation left by a replayed step. Under an arena limit no full graph holds
        the write (the engine runs piecewise graphs then), so a worst case the limit cannot hold reserves nothing
        and the write checks for itself, refusing what finds no room."""
        self.reserved = 0
        if not tokens:
            return
        self.refresh()
        if self.worst(self.bound, tokens) > self.capacity:
            self.checked += 1
            self.wait()
            try:
                self.make_room(tokens)
                if self.worst(self.bound, tokens) > self.capacity:  # longer than the arena's usual headroom
                    self.make_room(tokens, extra=self.worst(self.bound, tokens) - self.bound)
            except OverflowRoomError:
                if self.store.limit is None:
                    raise
                return
        self.arena_ref()
        self._count(tokens, launched=False)
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
        self._count(tokens, launched=True)

    def wait(self, misses_expected: bool = False) -> tuple[int, int]:
        """The device's top (entries) and the tiles that found no room, waiting for them; misses are expected only
        after a checked write."""
        top, missed = (int(x) for x in self.counters.tolist())  # the stream has run up to here
        # the bank's copy in flight has landed with it (it predates any checked write, so holds no misses of one):
        # taken here, before the exact top replaces the bound, so that it is never taken after later writes
        self.refresh()
        if not misses_expected:
            _no_misses(missed)
        self._epoch, self._since = 0, []
        self._exact(top * OVERFLOW_MIN_RUN)
        return top * OVERFLOW_MIN_RUN, missed

    def _exact(self, top: int) -> None:
        """The bound from the device's exact top (entries); a reserved write not launched yet runs after that top,
        so it stays counted."""
        self.bound = self.worst(top, self.reserved) if self.reserved else top

    def make_room(self, tokens: int, extra: int = 0) -> None:
        """After `wait`: compact (in place, or into a larger arena) if a write of `tokens` (bounded by
        HEADROOM_TOKENS) and `extra` more entries would not fit (`arena_target`)."""
        want = self.worst(self.bound, min(tokens, HEADROOM_TOKENS)) + extra
        if want <= self.capacity and not extra:
            return
        live = int(OverflowStore.unpack(self.store.ptr)[1].sum())
        target = arena_target(live, tokens, self.store.num_heads, self.head_size) + extra
        before = self.capacity
        limit = self.store.limit
        try:
            if limit is not None and target > limit:  # as much headroom as the limit leaves, if the write fits
                if live + extra > limit:
                    raise OverflowRoomError(f"a layer's overflow arena would need {2 * (live + extra) / 1e6:.3g} MB "
                                            f"({live} entries in runs), past its limit of {2 * limit / 1e6:.3g} MB")
                target = max(whole_runs(limit), live + extra)
            if -(-target // OVERFLOW_MIN_RUN) > MAX_UNITS:
                raise MemoryError(f"the Glyd overflow arena would pass {MAX_UNITS * OVERFLOW_MIN_RUN} entries "
                                  "(nearly every value of this cache an escape)")
            try:
                top = self.store.compact(target)
            except torch.OutOfMemoryError as exc:
                raise OverflowRoomError(
                    f"Glyd KV cache: a layer's overflow arena must grow to {2 * target / 1e6:.0f} MB ({live} entries "
                    "in runs: values far rarer than the KV tables expect) and the GPU has no room left; the write "
                    "that asked stored nothing without room. Lower gpu_memory_utilization to leave room beside vLLM's "
                    "budget, or run with GLYD_KV=off") from exc
        except BaseException:
            # misses `wait` reported belong to this failure (the write stays incomplete), not to a wrong bound: the
            # next snapshot must not report them as an ArenaFullError
            self.counters[1] = 0
            raise
        self.counters[0] = top // OVERFLOW_MIN_RUN
        self.counters[1] = 0
        self._exact(top)
        self.arena_ref()
        fresh = fresh_entries(self.store.num_heads, self.head_size)
        if self.capacity > max(before, fresh):
            log.warning("Glyd KV cache: a layer's overflow arena grew to %.1f MB (%d entries in runs), %.1f MB past "
                        "its first %.1f MB (taken before vLLM's memory profile): values rarer than the KV tables "
                        "expect",
                        2 * self.capacity / 1e6, live, 2 * (self.capacity - fresh) / 1e6, 2 * fresh / 1e6)


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


__all__ = ["ArenaFullError", "CounterBank", "DeviceRuns", "device_runs"]
