"""The KV page code: vLLM's fixed-size pages holding ~11.4 bits a bf16 value, every value exact.

Per token and KV head, K and V each store D sign/mantissa bytes, D 3-bit exponent codes (3 bit planes of
D/8 bytes) and E bytes of escape reserve. Each channel's table is a window of 7 exponents: code c < 7 means
exponent `base - c` (base >= 7, one byte a channel); 7 means "escape": the exponent is stored whole, in the
page's escape area, in (token, channel) order, so the j-th escape of a page is byte j of that area.
Windows and the bit order below let a GPU decode 4 values with a few 32-bit operations (kernels/).
The reserve is pooled over the page (B tokens x E
bytes), which absorbs the rare token with many escapes. Escapes beyond the reserve go to the block's
overflow run (`OverflowStore`), outside the page: the defined lossless path for rare prompts.

Layout of one page (one block, one KV head), B = block size, D = head size, sections in this order:
  k_sm  [B, D]        v_sm  [B, D]
  k_code[B, 3, D/8]   v_code[B, 3, D/8]     plane p's 32-bit word k (little endian), bit 8b + j = bit p of
                                            channel 32k + 4j + b's code (`code_bit_positions`)
  k_esc [B * E_k]     v_esc [B * E_v]
Appending token t writes row t of each section plus its escapes after those of rows < t (counted from
the code planes, so a page carries no counter and is valid for any fill). Nothing else is rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glyd_engine.errors import UnsupportedModelError
from glyd_engine.format import bf16

CODE_BITS = 3
ESCAPE = (1 << CODE_BITS) - 1  # code 7
TABLE_SIZE = ESCAPE  # exponents a channel's table holds
MIN_WINDOW_TOP = ESCAPE  # base - code never borrows, for any code 0..7: 4 codes subtract as one 32-bit word
UNSEEN_TOP = 126  # the window of a channel no calibration value reached: exponents 120..126 (|x| near 1/64..1)
WORD_CHANNELS = 32  # channels whose code bits share a 32-bit plane word


def code_bit_positions(head_size: int) -> torch.Tensor:
    """int64 [D]: where channel c's code bit sits in a row's plane (bit q = byte q // 8, bit q % 8).

    In each whole 32-channel word, channel 32k + 4j + b sits at bit 8b + j, so a rotate and a mask give the
    codes of channels 4j..4j+3 as the four bytes of one word. A tail of fewer than 32 channels (head sizes
    that are not multiples of 32; the GPU kernels refuse those) keeps the plain order, bit c.
    """
    c = torch.arange(head_size)
    whole = head_size - head_size % WORD_CHANNELS
    i = c % WORD_CHANNELS
    pos = c - i + 8 * (i % 4) + i // 4
    return torch.where(c < whole, pos, c)


def window_tables(bases: torch.Tensor) -> torch.Tensor:
    """uint8 [...] window tops -> decode tables uint8 [..., 7]: code c stands for base - c."""
    if bases.numel() and int(bases.min()) < MIN_WINDOW_TOP:
        raise ValueError(f"a window's top exponent must be at least {MIN_WINDOW_TOP}")
    codes = torch.arange(TABLE_SIZE, dtype=torch.int16, device=bases.device)
    return (bases.to(torch.int16).unsqueeze(-1) - codes).to(torch.uint8)


def window_bases(decode_table: torch.Tensor) -> torch.Tensor:
    """The tops of window decode tables [..., 7]; ValueError says what is wrong with any other table."""
    if decode_table.dtype != torch.uint8 or decode_table.shape[-1] != TABLE_SIZE:
        raise ValueError(f"decode tables must be uint8 [..., {TABLE_SIZE}], not {decode_table.dtype} "
                         f"{tuple(decode_table.shape)}")
    bases = decode_table[..., 0]
    if (bases.numel() and int(bases.min()) < MIN_WINDOW_TOP) or not torch.equal(window_tables(bases), decode_table):
        raise ValueError("decode tables must be windows (code c = top - c, top >= 7): tables from an older "
                         "Glyd; rebuild them")
    return bases


def best_windows(counts: torch.Tensor) -> torch.Tensor:
    """[..., 256] exponent counts -> decode tables [..., 7]: per channel the 7-wide window holding the most."""
    c = torch.nn.functional.pad(counts.to(torch.int64).cumsum(-1), (1, 0))  # c[..., i] = counts below i
    tops = torch.arange(MIN_WINDOW_TOP, 256, device=counts.device)
    held = c[..., tops + 1] - c[..., tops + 1 - TABLE_SIZE]
    # ties go to the highest top: exponents above a calibration's range are likelier than below it
    best = tops[(held.shape[-1] - 1) - torch.argmax(held.flip(-1), dim=-1)]
    best = torch.where(c[..., -1] > 0, best, UNSEEN_TOP)  # a channel with no counts: values near 1.0
    return window_tables(best.to(torch.uint8))


def default_escapes(head_size: int) -> int:
    """Escape bytes reserved per token when no calibration says otherwise: 3 per 64 values."""
    return max(1, (3 * head_size + 63) // 64)


@dataclass(frozen=True)
class KVPageLayout:
    head_size: int
    block_size: int
    k_escapes: int
    v_escapes: int

    def __post_init__(self) -> None:
        if self.head_size % 8 or self.head_size <= 0:
            raise UnsupportedModelError(f"head size {self.head_size} is not a multiple of 8: the KV page code "
                                        "needs whole bytes of codes; use GLYD_KV=off for this model")
        if self.block_size <= 0 or self.k_escapes < 0 or self.v_escapes < 0:
            raise ValueError("bad page layout")

    @property
    def code_bytes(self) -> int:
        return CODE_BITS * self.head_size // 8

    @property
    def token_bytes(self) -> int:
        """C: bytes per token per KV head, K and V together; independent of the block size."""
        return token_bytes(self.head_size, self.k_escapes, self.v_escapes)

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.token_bytes

    def sm_offset(self, kv: int) -> int:
        return kv * self.block_size * self.head_size

    def code_offset(self, kv: int) -> int:
        return 2 * self.block_size * self.head_size + kv * self.block_size * self.code_bytes

    def esc_offset(self, kv: int) -> int:
        base = 2 * self.block_size * (self.head_size + self.code_bytes)
        return base + (0 if kv == 0 else self.block_size * self.k_escapes)

    def reserve(self, kv: int) -> int:
        """Escape bytes in one page for K (kv=0) or V (kv=1)."""
        return self.block_size * (self.k_escapes if kv == 0 else self.v_escapes)

    def bits_per_value(self, kv: int) -> float:
        e = self.k_escapes if kv == 0 else self.v_escapes
        return 8 * (self.head_size + self.code_bytes + e) / self.head_size


def token_bytes(head_size: int, k_escapes: int, v_escapes: int) -> int:
    return 2 * (head_size + CODE_BITS * head_size // 8) + k_escapes + v_escapes


def encode_table(decode_table: torch.Tensor) -> torch.Tensor:
    """[..., 7] code -> exponent  =>  [..., 256] exponent -> code (ESCAPE where absent)."""
    lead = decode_table.shape[:-1]
    dec = decode_table.reshape(-1, TABLE_SIZE).to(torch.int64)
    enc = torch.full((dec.shape[0], 256), ESCAPE, dtype=torch.uint8)
    rows = torch.arange(dec.shape[0]).unsqueeze(1).expand_as(dec)
    codes = torch.arange(TABLE_SIZE, dtype=torch.uint8).expand_as(dec)
    # Reversed so that, were an exponent listed twice, the first code wins.
    enc[rows.flip(1), dec.flip(1)] = codes.flip(1)
    return enc.reshape(*lead, 256)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes (0..7) -> [..., 3, D/8] bit-plane bytes."""
    d = codes.shape[-1]
    by_bit = torch.empty_like(codes, dtype=torch.int32)
    by_bit[..., code_bit_positions(d)] = codes.to(torch.int32)  # code at its bit position
    c = by_bit.reshape(*codes.shape[:-1], d // 8, 8)
    weights = (1 << torch.arange(8, dtype=torch.int32))
    planes = [(((c >> p) & 1) * weights).sum(-1) for p in range(CODE_BITS)]
    return torch.stack(planes, dim=-2).to(torch.uint8)


_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.uint8)  # byte -> its 8 bits


def _unpack_codes(planes: torch.Tensor) -> torch.Tensor:
    """[..., 3, D/8] bit-plane bytes -> [..., D] codes (int64)."""
    bits = _BITS[planes.to(torch.int64)]  # [..., 3, D/8, 8]
    by_bit = bits[..., 0, :, :] | (bits[..., 1, :, :] << 1) | (bits[..., 2, :, :] << 2)
    d = planes.shape[-1] * 8
    return by_bit.reshape(*planes.shape[:-2], d)[..., code_bit_positions(d)].to(torch.int64)


OVERFLOW_MIN_RUN = 16  # bytes: the smallest overflow run; runs double as a page's overflow grows


@dataclass
class OverflowStore:
    """Escapes past a page's reserve: one run of bytes per (block, head, K/V) in a shared arena.

    `ptr[block, head, kv]` is an int32: -1 (no run) or `(offset // 16) << 4 | log2(capacity // 16)`, 4 bytes
    a page and K/V. Escape j >= reserve of a page is arena byte `offset + j - reserve`. A run is taken when
    a page first overflows, moved to a run twice the size when it fills, and given back when its block is
    rewritten from offset 0 (runs belong to the block id, as vLLM's pages do). The arena grows when no
    free run fits: rare prompts cost memory outside the pages, never data. `grows` counts those events.
    """

    num_blocks: int
    num_heads: int
    initial_bytes: int = 0
    ptr: torch.Tensor = field(init=False)
    arena: torch.Tensor = field(init=False)
    free: dict[int, list[int]] = field(init=False)
    grows: int = 0
    values_written: int = 0

    def __post_init__(self) -> None:
        self.ptr = torch.full((self.num_blocks, self.num_heads, 2), -1, dtype=torch.int32)
        # whole runs, so the arena stays a multiple of 16 bytes (the GPU kernels read it as 32-bit words)
        self.initial_bytes = -(-self.initial_bytes // OVERFLOW_MIN_RUN) * OVERFLOW_MIN_RUN
        self.arena = torch.zeros(self.initial_bytes, dtype=torch.uint8)
        self.free = {}
        self._top = 0

    @staticmethod
    def unpack(ptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(offset, capacity) in bytes, int64; capacity 0 where there is no run."""
        p = ptr.to(torch.int64)
        has = p >= 0
        offset = torch.where(has, (p >> 4) * OVERFLOW_MIN_RUN, torch.full_like(p, -1))
        capacity = torch.where(has, OVERFLOW_MIN_RUN << (p & 15), torch.zeros_like(p))
        return offset, capacity

    @property
    def bytes_held(self) -> int:
        """Arena bytes owned by pages now (what overflow costs), runs rounded up to powers of 2."""
        return int(self.unpack(self.ptr)[1].sum())

    def bytes_held_kv(self, kv: int) -> int:
        return int(self.unpack(self.ptr[..., kv])[1].sum())

    @property
    def nbytes(self) -> int:
        """The pointer table plus the arena."""
        return 4 * self.ptr.numel() + self.arena.numel()

    @property
    def runs_in_use(self) -> int:
        return int((self.ptr >= 0).sum())

    def release(self, blocks: torch.Tensor) -> None:
        """Give back every run of these blocks (they are being rewritten from offset 0)."""
        offset, capacity = self.unpack(self.ptr[blocks])
        held = offset >= 0
        for off, cap in zip(offset[held].tolist(), capacity[held].tolist(), strict=True):
            self.free.setdefault(int(cap), []).append(int(off))
        self.ptr[blocks] = -1

    def reserve_bytes(self, blocks: torch.Tensor, heads: torch.Tensor, kv: int, need: torch.Tensor) -> torch.Tensor:
        """Make each (block, head) hold at least `need` bytes; returns their offsets (int64).

        Entries may repeat a page: each page is grown once, to its largest need in the batch.
        """
        key = blocks * self.num_heads + heads
        pages, inverse = torch.unique(key, return_inverse=True)
        most = torch.zeros(pages.numel(), dtype=torch.int64, device=need.device)
        most.scatter_reduce_(0, inverse, need, "amax", include_self=False)
        pb, ph = pages // self.num_heads, pages % self.num_heads
        old_off, cap = self.unpack(self.ptr[pb, ph, kv])
        short = (cap < most).nonzero().flatten().tolist()
        for b, h, n, off, c in zip(pb[short].tolist(), ph[short].tolist(), most[short].tolist(),
                                   old_off[short].tolist(), cap[short].tolist(), strict=True):
            size = max(OVERFLOW_MIN_RUN, 1 << (n - 1).bit_length())
            new = self._take(size)
            if c:
                self.arena[new : new + c] = self.arena[off : off + c]
                self.free.setdefault(c, []).append(off)
            self.ptr[b, h, kv] = (new // OVERFLOW_MIN_RUN) << 4 | (size // OVERFLOW_MIN_RUN).bit_length() - 1
        return self.unpack(self.ptr[blocks, heads, kv])[0]

    def _take(self, size: int) -> int:
        runs = self.free.get(size)
        if runs:
            return runs.pop()
        if self._top + size > self.arena.numel():
            grow = max(self._top + size - self.arena.numel(), self.arena.numel(), 4096)
            self.arena = torch.cat([self.arena, torch.zeros(grow, dtype=torch.uint8, device=self.arena.device)])
            self.grows += 1
        self._top += size
        return self._top - size


@dataclass
class WriteStats:
    values: int = 0
    escapes: int = 0
    overflow: int = 0


class KVPageCodec:
    """Encode/decode one attention layer's pages with that layer's tables (torch reference, any device).

    `decode_table` is uint8[2, H, D, 7]: for K (0) and V (1), each KV head and channel, the exponent that
    code c stands for (windows: `window_tables`).
    """

    def __init__(self, layout: KVPageLayout, decode_table: torch.Tensor) -> None:
        two, heads, d, t = decode_table.shape
        if two != 2 or d != layout.head_size or t != TABLE_SIZE:
            raise ValueError(f"decode table shape {tuple(decode_table.shape)} does not fit {layout}")
        self.bases = window_bases(decode_table)
        self.layout = layout
        self.num_heads = heads
        self.dec = torch.cat([decode_table, torch.zeros(2, heads, d, 1, dtype=torch.uint8)], dim=-1)
        self.enc = encode_table(decode_table)
        self.stats = WriteStats()

    def new_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(num_blocks, self.num_heads, self.layout.page_bytes, dtype=torch.uint8)

    def new_overflow(self, num_blocks: int) -> OverflowStore:
        return OverflowStore(num_blocks, self.num_heads)

    # -- write -------------------------------------------------------------------------------------
    def write(self, cache: torch.Tensor, overflow: OverflowStore, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Append tokens: key/value [T, H, D] bf16 at `slots` (block * B + offset; -1 is padding).

        `cache` is [num_blocks, H, page_bytes] uint8 (any view of vLLM's tensor with that shape).
        """
        lay = self.layout
        B, D, H = lay.block_size, lay.head_size, self.num_heads
        slots = slots.to(torch.int64)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
        slots, order = torch.sort(slots, stable=True)
        key, value = key[order], value[order]
        blk, off = slots // B, slots % B
        ublk, inverse = torch.unique_consecutive(blk, return_inverse=True)
        first = torch.zeros(ublk.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, off, reduce="amin", include_self=False)
        restarted = ublk[first == 0]
        if restarted.numel():
            overflow.release(restarted)
        heads = torch.arange(H)
        rows = torch.arange(B)
        for kv, x in ((0, key), (1, value)):
            exp, sm = bf16.split(x)  # [T, H, D]
            exp = exp.to(torch.int64)
            codes = torch.take(self.enc[kv], (heads.view(1, H, 1) * D + torch.arange(D)) * 256 + exp)
            flags = (codes == ESCAPE).to(torch.int64)
            n_tok = flags.sum(-1)  # [T, H]
            # Escapes already in the page before the first row written now.
            co = lay.code_offset(kv)
            old = cache[ublk][:, :, co : co + B * lay.code_bytes].reshape(-1, H, B, CODE_BITS, D // 8)
            old_rows = (_unpack_codes(old) == ESCAPE).sum(-1)  # [U, H, B]
            base = (old_rows * (rows.view(1, 1, B) < first.view(-1, 1, 1))).sum(-1)  # [U, H]
            cum = torch.cumsum(n_tok, 0) - n_tok
            group_start = torch.zeros_like(base)
            group_start.scatter_reduce_(0, inverse.view(-1, 1).expand_as(cum), cum, reduce="amin",
                                        include_self=False)
            rank_tok = base[inverse] + cum - group_start[inverse]  # [T, H]
            rank = rank_tok.unsqueeze(-1) + torch.cumsum(flags, -1) - flags  # [T, H, D]
            # Rows of sign/mantissa and code planes.
            so = lay.sm_offset(kv)
            tok_idx = blk.view(-1, 1, 1)
            head_idx = heads.view(1, H, 1)
            cache[tok_idx, head_idx, so + off.view(-1, 1, 1) * D + torch.arange(D)] = sm
            cb = lay.code_bytes
            cache[tok_idx, head_idx, co + off.view(-1, 1, 1) * cb + torch.arange(cb)] = (
                _pack_codes(codes).reshape(-1, H, cb))
            # Escapes: in the page up to its reserve, the rest in the block's overflow run.
            t_i, h_i, d_i = flags.nonzero(as_tuple=True)
            self.stats.values += codes.numel()
            if t_i.numel() == 0:
                continue
            r = rank[t_i, h_i, d_i]
            e = exp[t_i, h_i, d_i].to(torch.uint8)
            res = lay.reserve(kv)
            inside = r < res
            eo = lay.esc_offset(kv)
            cache[blk[t_i[inside]], h_i[inside], eo + r[inside]] = e[inside]
            self.stats.escapes += int(t_i.numel())
            out = ~inside
            if bool(out.any()):
                ob, oh, orank = blk[t_i[out]], h_i[out], r[out] - res
                offsets = overflow.reserve_bytes(ob, oh, kv, orank + 1)
                overflow.arena[offsets + orank] = e[out]
                overflow.values_written += int(out.sum())
                self.stats.overflow += int(out.sum())

    # -- read --------------------------------------------------------------------------------------
    def read(self, cache: torch.Tensor, overflow: OverflowStore, blocks: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode whole pages: (K, V), each [N, H, B, D] bf16. Rows past a page's fill are garbage."""
        lay = self.layout
        B, D, H = lay.block_size, lay.head_size, self.num_heads
        blocks = blocks.to(torch.int64)
        pages = cache[blocks]  # [N, H, page_bytes]
        n = blocks.numel()
        heads = torch.arange(H)
        out = []
        for kv in (0, 1):
            so, co, eo = lay.sm_offset(kv), lay.code_offset(kv), lay.esc_offset(kv)
            sm = pages[:, :, so : so + B * D].reshape(n, H, B, D)
            codes = _unpack_codes(pages[:, :, co : co + B * lay.code_bytes].reshape(n, H, B, CODE_BITS, D // 8))
            exp = torch.take(self.dec[kv], (heads.view(1, H, 1, 1) * D + torch.arange(D)) * (TABLE_SIZE + 1)
                             + codes)
            flags = (codes == ESCAPE).reshape(n, H, B * D)
            f64 = flags.to(torch.int64)
            rank = torch.cumsum(f64, -1) - f64
            res = lay.reserve(kv)
            esc = pages[:, :, eo : eo + res].to(torch.int64)  # [N, H, res]
            flat_exp = exp.reshape(n, H, B * D)
            in_page = flags & (rank < res)
            if res:
                got = torch.gather(esc, 2, torch.clamp(rank, max=res - 1))
                flat_exp = torch.where(in_page, got.to(flat_exp.dtype), flat_exp)
            past = flags & (rank >= res)
            if bool(past.any()):
                n_i, h_i, v_i = past.nonzero(as_tuple=True)
                idx = rank[n_i, h_i, v_i] - res
                base, cap = overflow.unpack(overflow.ptr[blocks[n_i], h_i, kv])
                # Rows past a page's fill may point past its run or nowhere: they are garbage anyway.
                ok = (base >= 0) & (idx < cap)
                vals = torch.zeros(n_i.numel(), dtype=torch.uint8)
                vals[ok] = overflow.arena[base[ok] + idx[ok]]
                flat_exp[n_i, h_i, v_i] = vals.to(flat_exp.dtype)
            out.append(bf16.join(flat_exp.reshape(n, H, B, D), sm))
        return out[0], out[1]
