"""The KV page code (page code v3): vLLM's fixed-size pages at ~11.3 (or ~12.1) bits a bf16 value, every value exact.

A page (one block, one KV head) is B/16 tiles of 16 tokens. In a tile, K and V each keep per value:
  L     one byte: (c & 1) << 7 | mantissa
  hi    b bits: the sign and c's bits b-1 .. 1
where c = exponent - (top - 2^b + 1) is the exponent's place in its channel's window of 2^b exponents ending at
`top` (one byte a channel from the model's tables; b = 3, the default, or 4). Both planes are stored in the order of
a GPU lane's operand fragments of `mma.sync.m16n8k16` (K as the A operand of Sᵀ = K·Qᵀ, V as the A operand of
Oᵀ = Vᵀ·Pᵀ), so one lane's 16-byte loads hold exactly the values it feeds the tensor cores, and a pair of bf16
values is one byte permute of L and H = sign << 7 | (128 - 2^b + c) >> 1: the value scaled by 2^(127 - top), which
the attention kernel undoes on the query side (docs/format.md section 2).

A value outside its window (an **escape**; zeros, subnormals, inf and NaN always are) is stored with
c = exponent mod 2^b and listed in the tile's escape list as a 16-bit entry `o | (exponent >> b) << 11`, o being
its L byte's offset, so the value is `L`, `hi` and the entry together. K entries fill the tile's list from
its start, V entries from its end; what does not fit goes to the tile's overflow run (`OverflowStore`), the
defined lossless path for rare prompts. Appending token t writes its bytes and bits and appends its entries;
nothing already written is re-encoded or moved, and a write at a tile's token 0 starts the tile anew.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

import torch

from glyd_engine.errors import UnsupportedModelError
from glyd_engine.format import bf16

KV_PAGE_VERSION = 3  # changes whenever a page byte would; tables name the version they were built for
TILE = 16  # tokens a tile: one k-step of the P·V product, two n-blocks of the Q·Kᵀ product
CODE_BITS = (3, 4)  # the two codes: 3 bits (8-exponent windows, the densest) or 4 (16, far fewer escapes)
MAX_TOP = 254  # no window holds exponent 255 (inf, NaN), nor exponent 0 (tops >= the window): those always escape
UNSEEN_TOP = 127  # the window top of a channel no calibration value reached: |x| up to 2
HEAD_SIZES = (64, 128)  # D/2 values a lane per tile in 3-word units; escape offsets fit 11 bits
LANES = 32
POS_BITS = 11
TRAILER = 8  # u16 K entries, u16 V entries, u16 K entries in the page, u16 V entries in the page
RESERVE_STEP = 8  # tile bytes stay a multiple of 16: the reserve (entries) is 4 mod 8


def head_size_supported(head_size: int) -> bool:
    return head_size in HEAD_SIZES


def check_head_size(head_size: int) -> None:
    if not head_size_supported(head_size):
        raise UnsupportedModelError(
            f"head size {head_size}: the KV page code supports head sizes {' and '.join(map(str, HEAD_SIZES))}; "
            "use GLYD_KV=off for this model")


def window(code_bits: int) -> int:
    """Exponents a channel's window holds: top - window + 1 .. top."""
    if code_bits not in CODE_BITS:
        raise ValueError(f"the page code has {' and '.join(map(str, CODE_BITS))}-bit codes, not {code_bits}")
    return 1 << code_bits


def prescaled(code_bits: int) -> int:
    """The exponent code c decodes to in the kernel's scaled domain: 128 - window + c (120 + c or 112 + c)."""
    return 128 - window(code_bits)


def valid_reserve(entries: int) -> int:
    """The smallest reserve >= entries that keeps tiles a multiple of 16 bytes (4 mod 8, at least 4)."""
    entries = max(4, entries)
    return entries + (4 - entries) % RESERVE_STEP


ELEMENT_BYTES = 2  # vLLM views a page's bytes as bf16: C (bytes a token) must be a whole number of them


def page_reserve(head_size: int, entries: int, code_bits: int = 3) -> int:
    """The reserve a page holds for `entries` (>= it): whole 16-byte tiles, and C a whole number of bf16 elements.

    vLLM sizes each token's slot in its cache dtype; an odd C would be rounded up by vLLM and its pages padded, so
    the page code takes those bytes as escape room instead (8 more entries a tile) and pages stay dense."""
    r = valid_reserve(entries)
    while tile_bytes(head_size, r, code_bits) % (TILE * ELEMENT_BYTES):
        r += RESERVE_STEP
    return r


def plane_bytes(head_size: int, code_bits: int = 3) -> tuple[int, int]:
    """(L plane, hi plane) bytes of one tile's K or V."""
    return TILE * head_size, TILE * head_size * code_bits // 8


def tile_bytes(head_size: int, reserve: int, code_bits: int = 3) -> int:
    lp, hp = plane_bytes(head_size, code_bits)
    return 2 * (lp + hp) + TRAILER + 2 * reserve


def token_bytes(head_size: int, reserve: int, code_bits: int = 3) -> int:
    """C: bytes a token and KV head, K and V together; independent of the block size."""
    tb = tile_bytes(head_size, reserve, code_bits)
    if tb % TILE:
        raise ValueError(f"reserve {reserve} does not make whole 16-byte tiles (use valid_reserve)")
    return tb // TILE


# -- fragment order ------------------------------------------------------------------------------------------
def _h_words(head_size: int, code_bits: int) -> int:
    return code_bits * head_size // 64  # 32-bit words of hi bits a lane per tile


def _word_offsets(head_size: int, code_bits: int) -> torch.Tensor:
    """int64 [32 lanes, words]: byte offset of each lane's hi word in the hi plane (lane-major 16/8/4-byte chunks)."""
    nw = _h_words(head_size, code_bits)
    offs = torch.empty(LANES, nw, dtype=torch.int64)
    lane = torch.arange(LANES)
    k, base = 0, 0
    for size in (4, 2, 1):
        while nw - k >= size:
            for i in range(size):
                offs[:, k + i] = base + lane * 4 * size + 4 * i
            k += size
            base += LANES * 4 * size
    return offs


def hi_targets(code_bits: int) -> tuple[int, ...]:
    """The H-byte bits a value's hi fields fill: the sign (bit 7), then c's bits code_bits - 1 .. 1 (bits 1, 0 or
    2, 1, 0): H = sign << 7 | (prescaled + c) >> 1, whose other bits are constant (0x3C or 0x38)."""
    return (7, *range(code_bits - 2, -1, -1))


def group_hi_bits(q: int, code_bits: int = 3) -> list[tuple[int, int, int]]:
    """Where group q's hi bits sit: [(word, rotation, target bits of H it fills)], 1 or 2 pieces.

    3-bit code: a lane's groups come in units of 8 over 3 words: groups 0-2 unrotated in words 0-2 (H bits 7, 1,
    0 of each byte are word bits 8b+7, 8b+1, 8b), groups 3-5 rotated right by 3 (bits 8b+10, 8b+4, 8b+3), and
    groups 6 and 7 in the 2 bits a byte the others leave (bits 7 and 0 of H from words 0 and 1 rotated by 6; bit 1
    from word 2 rotated by 4 and 5). `rot(word, r) & mask | 0x3C3C3C3C` gives the four H bytes.
    4-bit code: two groups a word, unrotated (bits 8b+7, 8b+2..8b) and rotated by 4; `| 0x38383838`.
    """
    if code_bits == 4:
        return [(q // 2, 4 * (q % 2), 0x87)]
    u, r = divmod(q, 8)
    w = 3 * u
    if r < 3:
        return [(w + r, 0, 0x83)]
    if r < 6:
        return [(w + r - 3, 3, 0x83)]
    return [(w + r - 6, 6, 0x81), (w + 2, r - 2, 0x02)]


@functools.lru_cache(maxsize=16)
def fragment_maps(head_size: int, kv: int, code_bits: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """For K (kv=0) or V (kv=1) of one tile: (o [16, D], hbit [16, D, code_bits]) int64.

    o: the offset of value (t, d)'s L byte in the L plane; hbit: the bit (8 * byte + bit) of its sign and of c's
    bits code_bits - 1 .. 1 in the hi plane. The fragment of lane 4g + tig (g = lane / 4) holds, per group q of
    4 values (the registers a0/a2 or a1/a3 of an m16n8k16 A operand):
      K: token 8(q % 2) + g, channels 16(q / 2) + 2tig + {0, 1, 8, 9}
      V: channel 16(q / 2) + g + 8(q % 2), tokens 2tig + {0, 1, 8, 9}
    and its L bytes are lane-major 16-byte chunks: o = (q / 4) * 512 + lane * 16 + (q % 4) * 4 + b.
    """
    check_head_size(head_size)
    d_all = torch.arange(head_size)
    o = torch.empty(TILE, head_size, dtype=torch.int64)
    targets_h = hi_targets(code_bits)
    hbit = torch.empty(TILE, head_size, code_bits, dtype=torch.int64)
    woff = _word_offsets(head_size, code_bits)
    for t in range(TILE):
        for d in d_all.tolist():
            if kv == 0:
                nb, g = divmod(t, 8)
                ks, r = divmod(d, 16)
                half, r2 = divmod(r, 8)
                tig, lo = divmod(r2, 2)
                q, b = 2 * ks + nb, lo + 2 * half
            else:
                mb, r = divmod(d, 16)
                half, g = divmod(r, 8)
                hi_t, r2 = divmod(t, 8)
                tig, lo = divmod(r2, 2)
                q, b = 2 * mb + half, lo + 2 * hi_t
            lane = 4 * g + tig
            o[t, d] = (q // 4) * 512 + lane * 16 + (q % 4) * 4 + b
            targets = {}
            for word, rot, mask in group_hi_bits(q, code_bits):
                for p in targets_h:
                    if mask >> p & 1:  # word bit (8b + p + rot) % 32 of a little-endian word: its plane bit
                        targets[p] = 8 * int(woff[lane, word]) + ((8 * b + p + rot) % 32)
            for f, p in enumerate(targets_h):
                hbit[t, d, f] = targets[p]
    return o, hbit


@functools.lru_cache(maxsize=16)
def _inverse_o(head_size: int, kv: int) -> torch.Tensor:
    """int64 [16 * D]: the row-major (t, d) index of each L offset o."""
    o, _ = fragment_maps(head_size, kv)
    inv = torch.empty(TILE * head_size, dtype=torch.int64)
    inv[o.reshape(-1)] = torch.arange(TILE * head_size)
    return inv


# -- tables ----------------------------------------------------------------------------------------------------
def best_windows(counts: torch.Tensor, code_bits: int = 3) -> torch.Tensor:
    """[..., 256] exponent counts -> tops uint8 [...]: per channel the window (8 or 16 wide) holding the most."""
    w = window(code_bits)
    c = torch.nn.functional.pad(counts.to(torch.int64).cumsum(-1), (1, 0))  # c[..., i] = counts below i
    tops = torch.arange(w, MAX_TOP + 1, device=counts.device)
    held = c[..., tops + 1] - c[..., tops + 1 - w]
    # ties go to the highest top: exponents above a calibration's range are likelier than below it
    best = tops[(held.shape[-1] - 1) - torch.argmax(held.flip(-1), dim=-1)]
    best = torch.where(c[..., -1] > 0, best, UNSEEN_TOP)  # a channel with no counts: values near 1.0
    return best.to(torch.uint8)


def check_tops(tops: torch.Tensor, code_bits: int = 3) -> None:
    if tops.dtype != torch.uint8:
        raise ValueError(f"window tops must be uint8, not {tops.dtype}")
    w = window(code_bits)
    if tops.numel() and (int(tops.min()) < w or int(tops.max()) > MAX_TOP):
        raise ValueError(f"window tops must lie in {w}..{MAX_TOP} (no window may hold exponent 0 or 255)")


# -- layout ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVPageLayout:
    """A page: block_size / 16 tiles; a tile: [K L][V L][K hi][V hi][trailer][escape list of `reserve` u16]."""

    head_size: int
    block_size: int
    reserve: int  # escape-list entries a tile, K and V together
    code_bits: int = 3

    def __post_init__(self) -> None:
        check_head_size(self.head_size)
        window(self.code_bits)
        if self.block_size <= 0 or self.block_size % TILE:
            raise ValueError(f"block size {self.block_size}: KV pages need a multiple of {TILE}")
        if self.reserve != valid_reserve(self.reserve):
            raise ValueError(f"reserve {self.reserve} must be 4 mod 8 (whole 16-byte tiles)")

    @property
    def tiles(self) -> int:
        return self.block_size // TILE

    @property
    def token_bytes(self) -> int:
        return token_bytes(self.head_size, self.reserve, self.code_bits)

    @property
    def tile_bytes(self) -> int:
        return tile_bytes(self.head_size, self.reserve, self.code_bits)

    @property
    def page_bytes(self) -> int:
        return self.tiles * self.tile_bytes

    def l_offset(self, kv: int) -> int:
        return kv * plane_bytes(self.head_size, self.code_bits)[0]

    def h_offset(self, kv: int) -> int:
        lp, hp = plane_bytes(self.head_size, self.code_bits)
        return 2 * lp + kv * hp

    @property
    def trailer_offset(self) -> int:
        lp, hp = plane_bytes(self.head_size, self.code_bits)
        return 2 * (lp + hp)

    @property
    def list_offset(self) -> int:
        return self.trailer_offset + TRAILER

    def bits_per_value(self) -> float:
        return 8 * self.token_bytes / (2 * self.head_size)


# -- overflow ----------------------------------------------------------------------------------------------------
OVERFLOW_MIN_RUN = 8  # entries: the smallest overflow run; runs double as a tile's overflow grows


def whole_runs(entries: int) -> int:
    """The entries of an arena of at most `entries` that whole smallest runs fill (offsets count in runs)."""
    return entries // OVERFLOW_MIN_RUN * OVERFLOW_MIN_RUN


class OverflowRoomError(MemoryError):
    """A write's escapes found no room: the store's `limit` (or the device's memory) is reached. `slots` are the
    slots whose values were not stored (None: nothing of the write was); every other slot of the write is stored.
    The engine refuses the requests owning those slots' blocks (glyd_engine/vllm_plugin/refusals.py)."""

    def __init__(self, message: str, slots: torch.Tensor | None = None) -> None:
        super().__init__(message)
        self.slots = slots


@dataclass
class OverflowStore:
    """Escape entries past a tile's list: one run of u16 entries per (tile, head, K/V) in a shared arena.

    Tiles are numbered block * (block_size / 16) + tile. `ptr[tile, head, kv]` is an int32: -1 (no run) or
    `(offset // 8) << 4 | log2(capacity // 8)`, in entries; entry i past the tile's in-page count is arena
    entry `offset + i`. A run is taken on a tile's first overflow, moved to one twice the size when it fills,
    and given back when its tile is rewritten from token 0 (runs belong to the tile, as vLLM's pages do to
    the block id). The arena grows when no free run fits: rare prompts cost memory outside the pages, never
    data. `grows` counts those events, `compactions` the CUDA writer's repacks (in place or into a larger arena).
    `limit` (entries; None: the device's memory) caps the arena: a write that would pass it stores nothing and
    raises `OverflowRoomError` (the CPU writer), or leaves its short tiles unstored (the CUDA writer). `table`
    (int32, on `device`, at least `num_tiles * num_heads * 2` entries) is memory for `ptr`: the engine's, taken before
    vLLM profiled memory, so that its KV budget counts it.
    """

    num_tiles: int
    num_heads: int
    initial_entries: int = 0
    device: torch.device | str = "cpu"
    limit: int | None = None
    ptr: torch.Tensor = field(init=False)
    arena: torch.Tensor = field(init=False)
    free: dict[int, list[int]] = field(init=False)
    grows: int = 0
    compactions: int = 0
    values_written: int = 0
    device_runs: object = field(default=None, init=False, repr=False, compare=False)  # the CUDA writer's allocation
    table: InitVar[torch.Tensor | None] = None

    def __post_init__(self, table: torch.Tensor | None) -> None:
        shape = (self.num_tiles, self.num_heads, 2)
        if table is None:
            self.ptr = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        else:
            n = self.pointer_entries(self.num_tiles, self.num_heads)
            want = torch.device(self.device)
            if table.dtype != torch.int32 or table.dim() != 1 or table.numel() < n or \
                    table.device.type != want.type or want.index not in (None, table.device.index):
                raise ValueError(f"an overflow pointer table is int32 [>= {n}] on {self.device}, not {table.dtype} "
                                 f"{tuple(table.shape)} on {table.device}")
            self.ptr = table[:n].view(shape).fill_(-1)
        n = -(-self.initial_entries // OVERFLOW_MIN_RUN) * OVERFLOW_MIN_RUN
        self.arena = torch.zeros(n, dtype=torch.int16, device=self.device)
        self.free = {}
        self._top = 0

    @staticmethod
    def pointer_entries(num_tiles: int, num_heads: int) -> int:
        """The int32 entries of `ptr`: one a tile, head and K/V."""
        return num_tiles * num_heads * 2

    def adopt(self, arena: torch.Tensor) -> None:
        """Take `arena` (int16, on this store's device, contents unused) as the arena of a store with no runs yet:
        the engine's arena taken before vLLM profiled memory."""
        if self._top or bool((self.ptr >= 0).any()):
            raise ValueError("an overflow store adopts an arena only before its first run")
        if arena.dtype != torch.int16 or arena.dim() != 1 or arena.device != self.ptr.device:
            raise ValueError(f"an overflow arena is int16 [entries] on {self.ptr.device}, not {arena.dtype} "
                             f"{tuple(arena.shape)} on {arena.device}")
        self.arena = arena[: whole_runs(arena.numel())]

    @staticmethod
    def unpack(ptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(offset, capacity) in entries, int64; offset -1 and capacity 0 where there is no run."""
        p = ptr.to(torch.int64)
        has = p >= 0
        offset = torch.where(has, (p >> 4) * OVERFLOW_MIN_RUN, torch.full_like(p, -1))
        capacity = torch.where(has, OVERFLOW_MIN_RUN << (p & 15), torch.zeros_like(p))
        return offset, capacity

    @property
    def bytes_held(self) -> int:
        """Arena bytes owned by tiles now (what overflow costs), runs rounded up to powers of 2."""
        return 2 * int(self.unpack(self.ptr)[1].sum())

    @property
    def nbytes(self) -> int:
        """The pointer table plus the arena."""
        return 4 * self.ptr.numel() + 2 * self.arena.numel()

    @property
    def runs_in_use(self) -> int:
        return int((self.ptr >= 0).sum())

    def release(self, tiles: torch.Tensor) -> None:
        """Give back every run of these tiles (they are being rewritten from token 0)."""
        offset, capacity = self.unpack(self.ptr[tiles])
        held = offset >= 0
        for off, cap in zip(offset[held].tolist(), capacity[held].tolist(), strict=True):
            self.free.setdefault(int(cap), []).append(int(off))
        self.ptr[tiles] = -1

    def _short_runs(self, tiles: torch.Tensor, heads: torch.Tensor, kv: int, need: torch.Tensor
                    ) -> list[tuple[int, int, int, int, int]]:
        """The (tile, head) runs that hold fewer than `need` entries (repeats allowed): (tile, head, run size to
        take, old offset, old capacity) each."""
        key = tiles.to(torch.int64) * self.num_heads + heads.to(torch.int64)
        pages, inverse = torch.unique(key, return_inverse=True)
        most = torch.zeros(pages.numel(), dtype=torch.int64, device=need.device)
        most.scatter_reduce_(0, inverse, need.to(torch.int64), "amax", include_self=False)
        pt, ph = pages // self.num_heads, pages % self.num_heads
        old_off, cap = self.unpack(self.ptr[pt, ph, kv])
        short = (cap < most).nonzero().flatten().tolist()
        return [(t, h, max(OVERFLOW_MIN_RUN, 1 << (n - 1).bit_length()), off, c) for t, h, n, off, c in zip(
            pt[short].tolist(), ph[short].tolist(), most[short].tolist(), old_off[short].tolist(),
            cap[short].tolist(), strict=True)]

    def reserve_entries(self, tiles: torch.Tensor, heads: torch.Tensor, kv: int, need: torch.Tensor
                        ) -> torch.Tensor:
        """Make each (tile, head) run hold at least `need` entries (repeats allowed); their offsets (int64)."""
        for t, h, size, off, c in self._short_runs(tiles, heads, kv, need):
            new = self._take(size)
            if c:
                self.arena[new : new + c] = self.arena[off : off + c]
                self.free.setdefault(c, []).append(off)
            self.ptr[t, h, kv] = (new // OVERFLOW_MIN_RUN) << 4 | (size // OVERFLOW_MIN_RUN).bit_length() - 1
        return self.unpack(self.ptr[tiles, heads, kv])[0]

    def growth_for(self, wants: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]) -> int:
        """Entries past the top that `reserve_entries` would take for these (tiles, heads, kv, need) requests, free
        runs of the right size counted first (a moved run's old space is not: an upper bound)."""
        sizes = [run[2] for tiles, heads, kv, need in wants for run in self._short_runs(tiles, heads, kv, need)]
        free = {size: len(runs) for size, runs in self.free.items()}
        grow = 0
        for size in sizes:
            if free.get(size, 0):
                free[size] -= 1
            else:
                grow += size
        return grow

    def has_room(self, entries: int) -> bool:
        """Whether `entries` more past the top stay within the limit."""
        return self.limit is None or self._top + entries <= self.limit

    def check_room(self, entries: int) -> None:
        """Raise `OverflowRoomError` if `entries` more past the top would pass the limit."""
        if not self.has_room(entries):
            raise self._past_limit(self._top + entries)

    def _past_limit(self, entries: int) -> OverflowRoomError:
        return OverflowRoomError(f"the Glyd overflow arena would need {2 * entries / 1e6:.1f} MB, past its limit of "
                                 f"{2 * (self.limit or 0) / 1e6:.1f} MB")

    def compact(self, capacity: int) -> int:
        """Move the live runs to the front of an arena of at least `capacity` entries, in pointer order, and
        rewrite their pointers; returns the entries they take (the new top). Space of moved or given-back runs
        (the CUDA writer leaves a grown run's old space behind) is reclaimed here. The arena stays where it is when
        it is large enough (an engine's first arena is inside vLLM's KV budget), else a larger one replaces it."""
        offset, cap = self.unpack(self.ptr)
        live = (offset >= 0).view(-1)
        offs, caps = offset.view(-1)[live], cap.view(-1)[live]
        starts = torch.cumsum(caps, 0) - caps
        top = int(caps.sum())
        size = -(-max(capacity, top) // OVERFLOW_MIN_RUN) * OVERFLOW_MIN_RUN
        grow = size > self.arena.numel()
        if grow and self.limit is not None and size > self.limit:
            raise self._past_limit(size)
        arena = torch.zeros(size, dtype=torch.int16, device=self.arena.device) if grow else self.arena
        if top:
            run = torch.repeat_interleave(torch.arange(caps.numel(), device=caps.device), caps)
            within = torch.arange(top, device=caps.device) - starts[run]
            arena[:top] = self.arena[offs[run] + within]  # the gather copies first, so in place is safe
            flat = self.ptr.view(-1)
            flat[live] = ((starts // OVERFLOW_MIN_RUN) << 4 | (flat[live] & 15).to(torch.int64)).to(torch.int32)
        self.arena, self.free, self._top = arena, {}, top
        self.grows += grow
        self.compactions += 1
        return top

    def _take(self, size: int) -> int:
        runs = self.free.get(size)
        if runs:
            return runs.pop()
        if self._top + size > self.arena.numel():
            self.check_room(size)  # `growth_for` checked the write: only a bug gets here past the limit
            grow = max(self._top + size - self.arena.numel(), self.arena.numel(), 2048)
            if self.limit is not None:
                grow = max(self._top + size - self.arena.numel(), min(grow, self.limit - self.arena.numel()))
            self.arena = torch.cat([self.arena, torch.zeros(grow, dtype=torch.int16, device=self.arena.device)])
            self.grows += 1
        self._top += size
        return self._top - size


def write_by_block(write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None], key: torch.Tensor,
                   value: torch.Tensor, slots: torch.Tensor, block_size: int,
                   escapes: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """`write(key, value, slots)`; where its escapes find no overflow room (`OverflowRoomError`), each block of it
    alone, those with the fewest escapes a token first (`escapes()`: [T], asked only then), so that ordinary text is
    stored before the rare text that filled the arena. Returns the slots not stored (empty: all were): their blocks'
    requests are refused, and every other value of the write is exact."""
    try:
        write(key, value, slots)
        return slots[:0]
    except OverflowRoomError as exc:
        if exc.slots is not None:  # the writer stored the rest itself
            return exc.slots
    slots = slots.to(torch.int64)
    keep = slots >= 0
    blocks, inverse = torch.unique(slots[keep] // block_size, return_inverse=True)
    if escapes is not None:
        rate = torch.zeros(blocks.numel(), dtype=torch.float64).index_add_(0, inverse, escapes()[keep].double())
        rate /= torch.bincount(inverse, minlength=blocks.numel()).double()
        blocks = blocks[torch.argsort(rate, stable=True)]
    lost = []
    for b in blocks.tolist():
        sel = keep & (slots // block_size == b)
        try:
            write(key[sel], value[sel], slots[sel])
        except OverflowRoomError as exc:
            lost.append(slots[sel] if exc.slots is None else exc.slots)
    return torch.cat(lost) if lost else slots[:0]


@dataclass
class WriteStats:
    values: int = 0
    escapes: int = 0
    overflow: int = 0


# -- codec -------------------------------------------------------------------------------------------------------
_U16 = 0xFFFF


def _u16(x: torch.Tensor) -> torch.Tensor:
    """int64 values 0..65535 -> int16 bit patterns."""
    return torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)


class KVPageCodec:
    """Encode/decode one attention layer's pages with that layer's window tops (torch reference, any device).

    `tops` is uint8 [2, H, D]: for K (0) and V (1), each KV head and channel, the top of its 8-exponent window.
    `cache` arguments are [num_blocks, H, page_bytes] uint8 (any view of vLLM's tensor with that shape).
    """

    def __init__(self, layout: KVPageLayout, tops: torch.Tensor) -> None:
        two, heads, d = tops.shape
        if two != 2 or d != layout.head_size:
            raise ValueError(f"window tops of shape {tuple(tops.shape)} do not fit {layout}")
        check_tops(tops, layout.code_bits)
        self.layout = layout
        self.tops = tops
        self.num_heads = heads
        self.stats = WriteStats()

    def new_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(num_blocks, self.num_heads, self.layout.page_bytes, dtype=torch.uint8)

    def new_overflow(self, num_blocks: int) -> OverflowStore:
        return OverflowStore(num_blocks * self.layout.tiles, self.num_heads)

    # -- write -----------------------------------------------------------------------------------------------
    def _window_codes(self, e: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exponents e [T, H, D] (int64) as codes in their channel's window, and which escape it."""
        w = window(self.layout.code_bits)
        c = e - (self.tops[kv].to(torch.int64).unsqueeze(0) - (w - 1))
        return c, (c < 0) | (c >= w)

    def escapes(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Values a token [T] (K and V) outside their channel's window: what a write must list or overflow."""
        n = torch.zeros(key.shape[0], dtype=torch.int64)
        for kv, x in ((0, key), (1, value)):
            n += self._window_codes(bf16.split(x)[0].to(torch.int64), kv)[1].flatten(1).sum(1).cpu()
        return n

    def write(self, cache: torch.Tensor, overflow: OverflowStore, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Append tokens: key/value [T, H, D] bf16 at `slots` (block * B + offset; -1 is padding)."""
        lay = self.layout
        D, H = lay.head_size, self.num_heads
        slots = slots.to(torch.int64)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
        slots, order = torch.sort(slots, stable=True)
        key, value = key[order], value[order]
        blk, off = slots // lay.block_size, slots % lay.block_size
        tile = blk * lay.tiles + off // TILE  # global tile id
        t_in = off % TILE
        utile, inverse = torch.unique_consecutive(tile, return_inverse=True)
        first = torch.full((utile.numel(),), TILE, dtype=torch.int64)
        first.scatter_reduce_(0, inverse, t_in, reduce="amin", include_self=True)
        restarted = utile[first == 0]
        if restarted.numel():
            overflow.release(restarted)
        tiles = cache.unflatten(2, (lay.tiles, lay.tile_bytes))  # a view at the cache's block and head strides
        blk_u, sub_u = utile // lay.tiles, utile % lay.tiles
        work = tiles[blk_u, :, sub_u].clone()  # the touched tiles [U, H, tile_bytes], written back at the end
        U = utile.numel()
        heads = torch.arange(H)
        # Old counts (zero for restarted tiles).
        tr = lay.trailer_offset
        cnt = trailer_counts(work, lay)  # [U, H, 4]
        cnt = torch.where((first == 0).view(U, 1, 1), torch.zeros_like(cnt), cnt)
        n_tot = cnt[..., 0:2].clone()  # [U, H, kv]: entries so far
        n_in = cnt[..., 2:4].clone()  # entries in the page
        entries_by_kv = []
        cb = lay.code_bits
        w = window(cb)
        for kv, x in ((0, key), (1, value)):
            e, sm = bf16.split(x)  # [T, H, D]
            e = e.to(torch.int64)
            s, m = (sm.to(torch.int64) >> 7) & 1, sm.to(torch.int64) & 0x7F
            c, esc = self._window_codes(e, kv)
            c = torch.where(esc, e & (w - 1), c)
            lbyte = ((c & 1) << 7) | m
            hi = torch.stack([s, *((c >> j) & 1 for j in range(cb - 1, 0, -1))], -1)  # [T, H, D, code_bits]
            o, hbit = fragment_maps(D, kv, cb)
            # L bytes
            lo = lay.l_offset(kv)
            row = inverse.view(-1, 1, 1).expand(-1, H, D)
            hh = heads.view(1, H, 1).expand_as(row)
            pos = lo + o[t_in].unsqueeze(1).expand(-1, H, -1)  # [T, H, D]
            work[row, hh, pos] = lbyte.to(torch.uint8)
            # hi bits: several values share a byte; no two share a bit, so sums of bits are ORs
            ho, hp = lay.h_offset(kv), plane_bytes(D, cb)[1]
            bits = hbit[t_in].unsqueeze(1)  # [T, 1, D, cb]
            at = ((row * H + hh).unsqueeze(-1) * hp + bits // 8).reshape(-1)
            one = (1 << (bits % 8)).to(torch.int32).expand(-1, H, -1, -1).reshape(-1)
            mask = torch.zeros(U * H * hp, dtype=torch.int32).index_add_(0, at, one)
            new = torch.zeros(U * H * hp, dtype=torch.int32).index_add_(0, at, one * hi.reshape(-1).to(torch.int32))
            plane = work[:, :, ho : ho + hp].reshape(-1).to(torch.int32)
            work[:, :, ho : ho + hp] = ((plane & ~mask) | new).to(torch.uint8).view(U, H, hp)
            # escape entries, in (token, channel) order per tile and head
            t_i, h_i, d_i = esc.nonzero(as_tuple=True)  # token-major, then head, then channel
            ent = o[t_in[t_i], d_i] | ((e[t_i, h_i, d_i] >> cb) << POS_BITS)
            entries_by_kv.append((inverse[t_i], h_i, t_in[t_i], d_i, ent))
        self._append_entries(work, overflow, utile, n_tot, n_in, entries_by_kv)  # may refuse: nothing stored
        self.stats.values += 2 * key.numel()  # counted once stored
        self.stats.escapes += sum(int(e[0].numel()) for e in entries_by_kv)
        cnt = torch.cat([n_tot, n_in], -1)
        work[:, :, tr : tr + TRAILER] = _u16(cnt).view(torch.uint8).view(U, H, TRAILER)
        tiles[blk_u, :, sub_u] = work

    def _append_entries(self, work: torch.Tensor, overflow: OverflowStore, utile: torch.Tensor,
                        n_tot: torch.Tensor, n_in: torch.Tensor, entries_by_kv: list) -> None:
        """Give each new entry its slot: in token order, K's before V's, in the page while the list has room
        (K from its start, V from its end), then in the tile's overflow run."""
        lay = self.layout
        R = lay.reserve
        lst = lay.list_offset
        U, H = n_tot.shape[:2]
        # merge K and V entries into one stream ordered by (tile, head, token, kv, channel)
        parts = []
        for kv, (u, h, t, d, ent) in enumerate(entries_by_kv):
            parts.append(torch.stack([u, h, t, torch.full_like(u, kv), d, ent], 1))
        allv = torch.cat(parts, 0)
        if allv.numel() == 0:
            return
        key = ((allv[:, 0] * H + allv[:, 1]) * TILE + allv[:, 2]) * 2 + allv[:, 3]
        key = key * 256 + allv[:, 4]
        allv = allv[torch.argsort(key, stable=True)]
        u, h, kv, ent = allv[:, 0], allv[:, 1], allv[:, 3], allv[:, 5]
        grp = u * H + h
        # rank of each entry within its (tile, head), and within its (tile, head, kv)
        _, grp_start = torch.unique_consecutive(grp, return_counts=True)
        starts = torch.repeat_interleave(torch.cumsum(grp_start, 0) - grp_start, grp_start)
        rank = torch.arange(grp.numel()) - starts
        is_v = kv
        cum_v = torch.cumsum(is_v, 0) - is_v
        cum_v = cum_v - cum_v[starts]  # V entries before this one in its (tile, head)
        cum_k = rank - cum_v
        base_tot = n_tot[u, h]  # [N, 2]
        base_in = n_in[u, h]
        full_before = (base_in.sum(-1) >= R) | (base_tot != base_in).any(-1)  # list already full
        free = R - base_in.sum(-1)
        # an entry goes in the page iff the list had room for every new entry before it and for it
        in_page = (~full_before) & (rank < free)
        idx_kind = torch.where(is_v.bool(), base_tot[:, 1] + cum_v, base_tot[:, 0] + cum_k)  # entry index in kind
        in_kind = torch.where(is_v.bool(), base_in[:, 1], base_in[:, 0])
        cum_in_k = torch.cumsum(in_page & ~is_v.bool(), 0) - (in_page & ~is_v.bool()).long()
        cum_in_v = torch.cumsum(in_page & is_v.bool(), 0) - (in_page & is_v.bool()).long()
        cum_in_k = cum_in_k - cum_in_k[starts]
        cum_in_v = cum_in_v - cum_in_v[starts]
        slot = torch.where(is_v.bool(), R - 1 - (base_in[:, 1] + cum_in_v), base_in[:, 0] + cum_in_k)
        if bool(in_page.any()):
            sel = in_page
            pos = lst + 2 * slot[sel]
            val = _u16(ent[sel]).view(torch.uint8).view(-1, 2).to(torch.uint8)
            work[u[sel], h[sel], pos] = val[:, 0]
            work[u[sel], h[sel], pos + 1] = val[:, 1]
        out = ~in_page
        if bool(out.any()):
            # overflow index within kind = entry index - entries of that kind in the page
            n_in_kind_final = in_kind + torch.where(is_v.bool(), cum_in_v, cum_in_k)
            oidx = idx_kind - n_in_kind_final
            if overflow.limit is not None:  # checked before anything of the write is stored
                wants = [(utile[u[out & (kv == k)]], h[out & (kv == k)], k, oidx[out & (kv == k)] + 1) for k in (0, 1)]
                if not overflow.has_room(overflow.growth_for(wants)):
                    overflow.compact(overflow.arena.numel())  # given-back runs' space to the top, then look again
                    overflow.check_room(overflow.growth_for(wants))
            for k in (0, 1):
                sel = out & (kv == k)
                if bool(sel.any()):
                    offs = overflow.reserve_entries(utile[u[sel]], h[sel], k, oidx[sel] + 1)
                    overflow.arena[offs + oidx[sel]] = _u16(ent[sel])
            overflow.values_written += int(out.sum())
            self.stats.overflow += int(out.sum())
        # new counts
        for k in (0, 1):
            selk = kv == k
            n_tot[..., k].index_put_((u[selk], h[selk]), torch.ones(int(selk.sum()), dtype=torch.int64),
                                     accumulate=True)
            seli = selk & in_page
            n_in[..., k].index_put_((u[seli], h[seli]), torch.ones(int(seli.sum()), dtype=torch.int64),
                                    accumulate=True)

    # -- read ------------------------------------------------------------------------------------------------
    def read(self, cache: torch.Tensor, overflow: OverflowStore, blocks: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode whole pages: (K, V), each [N, H, B, D] bf16. Rows past a page's fill are garbage."""
        lay = self.layout
        D, H, nt = lay.head_size, self.num_heads, lay.tiles
        blocks = blocks.to(torch.int64)
        n = blocks.numel()
        tiles = cache[blocks].view(n, H, nt, lay.tile_bytes).transpose(1, 2).reshape(n * nt, H, lay.tile_bytes)
        tile_ids = (blocks.view(-1, 1) * nt + torch.arange(nt)).reshape(-1)
        k, v = decode_tiles(tiles, tile_ids, self.tops, lay, overflow)  # [N*nt, H, 16, D]
        shape = lambda x: x.view(n, nt, H, TILE, D).transpose(1, 2).reshape(n, H, nt * TILE, D)  # noqa: E731
        return shape(k), shape(v)


def trailer_counts(tiles: torch.Tensor, lay: KVPageLayout) -> torch.Tensor:
    """Tiles [..., tile_bytes] uint8 -> their trailers [..., 4] int64: K entries, V entries, K and V in the page."""
    tr = lay.trailer_offset
    return tiles[..., tr : tr + TRAILER].contiguous().view(torch.int16).to(torch.int64) & _U16


def escapes_held(pages: torch.Tensor, lay: KVPageLayout) -> tuple[int, int]:
    """(escape entries, of which in overflow runs) the tiles' trailers count in pages [blocks, H, page_bytes]: what
    the cache holds now, the tiles of freed blocks included until they are rewritten (vLLM zeroes its cache when it
    allocates it, so a block never written counts none). Either writer's pages: the CUDA writer keeps no host-side
    counts."""
    tiles = pages[:, :, : lay.page_bytes].unflatten(2, (lay.tiles, lay.tile_bytes))  # a view: no copy of the cache
    cnt = trailer_counts(tiles, lay)  # [n, H, tiles, 4]
    total = cnt[..., 0] + cnt[..., 1]
    return int(total.sum()), int((total - cnt[..., 2] - cnt[..., 3]).sum())


def decode_tiles(tiles: torch.Tensor, tile_ids: torch.Tensor, tops: torch.Tensor, lay: KVPageLayout,
                 overflow: OverflowStore | None) -> tuple[torch.Tensor, torch.Tensor]:
    """tiles [N, H, tile_bytes] uint8 -> (K, V) [N, H, 16, D] bf16; `tile_ids` name their overflow runs."""
    n, H, _ = tiles.shape
    D = lay.head_size
    R = lay.reserve
    cnt = trailer_counts(tiles, lay)  # [N, H, 4]
    lst = tiles[:, :, lay.list_offset : lay.list_offset + 2 * R].contiguous().view(torch.int16).to(
        torch.int64) & _U16  # [N, H, R]
    cb = lay.code_bits
    keep = 0x8000 | ((window(cb) - 1) << 7) | 0x7F  # sign, c's place in the exponent, mantissa
    out = []
    for kv in (0, 1):
        o_of_td, word, rot, mask, chan = _read_plan(D, kv, cb)
        lo, ho = lay.l_offset(kv), lay.h_offset(kv)
        lp, hp = plane_bytes(D, cb)
        # The GPU's decode, a word at a time: a lane's hi words -> the four H bytes of each of its groups.
        words = _lane_words(tiles[:, :, ho : ho + hp], D, cb)  # int64 [N, H, 32 lanes, words]
        h4 = torch.zeros(n, H, LANES, D // 8, dtype=torch.int64)
        for piece in range(word.shape[0]):
            x = words.index_select(-1, word[piece])  # [N, H, 32, groups]
            r = rot[piece]
            x = ((x >> r) | (x << ((32 - r) % 32))) & 0xFFFFFFFF
            h4 |= x & mask[piece]
        h4 |= _HCONST[cb]
        hbytes = h4.to(torch.int32).view(torch.uint8).view(n, H, LANES, D // 32, 4, 4)  # [.., lane, q/4, q%4, b]
        hbytes = hbytes.permute(0, 1, 3, 2, 4, 5).reshape(n, H, lp)  # fragment order o
        lbytes = tiles[:, :, lo : lo + lp]
        scaled16 = (hbytes.to(torch.int16) << 8) | lbytes.to(torch.int16)  # the kernel's decoded value, order o
        exp_shift = ((tops[kv].to(torch.int16) - 127) << 7).index_select(-1, chan).view(1, H, lp)
        bits = (scaled16 + exp_shift).to(torch.int64) & _U16  # exponent 128 - 2^b + c -> top - 2^b + 1 + c
        scaled = scaled16.to(torch.int64) & _U16
        # escapes: the page's list (K from the start, V from the end), then the overflow run
        n_tot, n_in = cnt[..., kv].clamp(max=TILE * D), cnt[..., 2 + kv]  # garbage counts of unwritten tiles
        slots = torch.arange(R)
        if kv == 1:
            slots = R - 1 - slots
        ents = lst[:, :, slots]  # [N, H, R] in entry order
        ok = torch.arange(R).view(1, 1, R) < n_in.clamp(max=R).unsqueeze(-1)
        ent_list = [(ents, ok)]
        if overflow is not None and bool((n_tot > n_in).any()):
            more = int((n_tot - n_in).clamp(min=0).max())
            base, cap = OverflowStore.unpack(overflow.ptr[tile_ids].to(tiles.device)[..., kv])  # [N, H]
            j = torch.arange(more)
            idx = base.unsqueeze(-1) + j
            good = (j < (n_tot - n_in).unsqueeze(-1)) & (j < cap.unsqueeze(-1)) & (base.unsqueeze(-1) >= 0)
            arena = overflow.arena.to(torch.int64) & _U16
            vals = torch.where(good, arena[idx.clamp(0, max(0, arena.numel() - 1))] if arena.numel() else
                               torch.zeros_like(idx), torch.zeros_like(idx))
            ent_list.append((vals, good))
        for ents, good in ent_list:
            if not bool(good.any()):
                continue
            ni, hi_, ji = good.nonzero(as_tuple=True)
            ent = ents[ni, hi_, ji]
            o = (ent & ((1 << POS_BITS) - 1)) % (TILE * D)  # in range even for a tile nobody wrote
            bits[ni, hi_, o] = (scaled[ni, hi_, o] & keep) | ((ent >> POS_BITS) << (7 + cb))
        out.append(_u16(bits).index_select(-1, o_of_td).view(n, H, TILE, D).view(torch.bfloat16))
    return out[0], out[1]


_HCONST = {3: 0x3C3C3C3C, 4: 0x38383838}  # H's constant bits: (128 - 2^b) >> 1 in every byte


def _lane_words(plane: torch.Tensor, head_size: int, code_bits: int) -> torch.Tensor:
    """A tile's hi plane [N, H, bytes] -> each lane's words, int64 [N, H, 32, words] (chunks of 4, 2, 1 words)."""
    n, h, _ = plane.shape
    nw = _h_words(head_size, code_bits)
    parts, k, base = [], 0, 0
    for size in (4, 2, 1):
        while nw - k >= size:
            chunk = plane[:, :, base : base + LANES * 4 * size].reshape(n, h, LANES, 4 * size)
            parts.append(chunk.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
            k += size
            base += LANES * 4 * size
    return torch.cat(parts, -1)


@functools.lru_cache(maxsize=16)
def _read_plan(head_size: int, kv: int, code_bits: int) -> tuple[torch.Tensor, ...]:
    """For the word-wide decode: o of each (token, channel) [16D]; for each of a group's (up to 2) pieces the word,
    rotation and mask of every group [pieces, D/8]; the channel of each o [16D]."""
    ng = head_size // 8
    pieces = [group_hi_bits(q, code_bits) for q in range(ng)]
    npiece = max(len(p) for p in pieces)
    word = torch.zeros(npiece, ng, dtype=torch.int64)
    rot = torch.zeros(npiece, ng, dtype=torch.int64)
    mask = torch.zeros(npiece, ng, dtype=torch.int64)
    for q, ps in enumerate(pieces):
        for i, (w, r, m) in enumerate(ps):
            word[i, q], rot[i, q], mask[i, q] = w, r, m * 0x01010101
    o, _ = fragment_maps(head_size, kv, code_bits)
    chan = torch.empty(TILE * head_size, dtype=torch.int64)
    chan[o.reshape(-1)] = torch.arange(head_size).repeat(TILE)
    return o.reshape(-1), word, rot, mask, chan
