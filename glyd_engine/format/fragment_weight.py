"""The fragment-order weight code: how a Glyd weight is held on an NVIDIA GPU for the CUDA matmul.

The resident code (format/resident.py) is laid out row-major for the torch decode; the CUDA matmul
(kernels/cuda/matmul.cu) wants each lane's 16-byte loads to hold exactly the values of its tensor-core
fragments, bytes that become bf16 pairs with one byte permute. This module is that layout's reference: it
builds it from bf16 bits and decodes it with the kernel's own word arithmetic, on any device, so CPU tests
check what the GPU reads. 12 bits a weight plus 4 bytes an escape (docs/format.md section 4.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE_ROWS = 16  # rows of W an MMA tile holds
CHUNK_COLS = 64  # columns of a chunk: four k16 steps
CHUNK_BYTES = 3 * 32 * 16  # planes L(g), L(g + 8), H; 32 lanes; 16 bytes a lane
WINDOW = 15  # codes 1..15 are exponents lo + 1 .. lo + 15; code 0 is an escape
MAX_LO = 238  # lo is even and the window's top (lo + 15) a finite exponent
HMASK = 0x87878787
GROUP_COLS = 512  # colptr's column groups: the wide CUDA matmul splits K at their boundaries


@dataclass
class FragmentWeight:
    shape: tuple[int, int]  # (N, K): y = x @ W.T
    data: torch.Tensor  # uint8 [N/16 * K/64 * 1536]: (tile, chunk) blocks of three 512-byte planes
    lo: int  # even; a code c decodes to exponent lo + c
    rowptr: torch.Tensor  # int32 [N + 1]: row n's escapes are entries rowptr[n] .. rowptr[n + 1] - 1
    esc: torch.Tensor  # int32 [e]: column << 16 | the value's bf16 bits, columns ascending within a row
    # int16 [ceil(K / 512) - 1, N], read as uint16: row n's escapes in columns below 512 (q + 1), an index of `esc`
    # for the matmul that splits K at those columns (None: made when needed, `with_colptr`)
    colptr: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        extra = 2 * self.colptr.numel() if self.colptr is not None else 0
        return self.data.numel() + 4 * (self.rowptr.numel() + self.esc.numel()) + extra

    @property
    def bits_per_value(self) -> float:
        return 8 * self.nbytes / max(1, self.numel)

    def to(self, device: torch.device | str) -> FragmentWeight:
        return FragmentWeight(self.shape, self.data.to(device), self.lo, self.rowptr.to(device), self.esc.to(device),
                              None if self.colptr is None else self.colptr.to(device))

    def with_colptr(self) -> FragmentWeight:
        return self if self.colptr is not None else FragmentWeight(
            self.shape, self.data, self.lo, self.rowptr, self.esc, column_index(self.shape, self.rowptr, self.esc))


def column_index(shape: tuple[int, int], rowptr: torch.Tensor, esc: torch.Tensor) -> torch.Tensor:
    """`colptr` of a weight's escape list (see FragmentWeight): a row has fewer than K < 2^16 escapes."""
    n, k = shape
    dev = rowptr.device
    counts = (rowptr[1:] - rowptr[:-1]).to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(n, device=dev), counts)
    key = rows << 16 | ((esc.to(torch.int64) & 0xFFFFFFFF) >> 16)  # ascending: rows, then columns
    ends = torch.arange(1, -(-k // GROUP_COLS), device=dev)[:, None] * GROUP_COLS
    below = torch.searchsorted(key, ((torch.arange(n, device=dev)[None, :] << 16) + ends).reshape(-1))
    below = below.view(-1, n) - rowptr[None, :-1].to(torch.int64)
    return torch.where(below >= 1 << 15, below - (1 << 16), below).to(torch.int16).contiguous()


def unsupported(shape: tuple[int, ...]) -> str | None:
    """Why a weight of this shape cannot take the fragment layout (None: it can)."""
    if len(shape) != 2:
        return f"the fragment layout holds 2-D weights, not {len(shape)}-D"
    n, k = shape
    if n % TILE_ROWS or k % CHUNK_COLS or n == 0 or k == 0:
        return f"rows must be a multiple of {TILE_ROWS} and columns of {CHUNK_COLS}, not {n} x {k}"
    if k >= 1 << 16:
        return f"{k} columns: escape entries hold a 16-bit column"
    return None


def choose_lo(exp_hist: torch.Tensor) -> int:
    """The even lo whose window (exponents lo + 1 .. lo + 15) holds the most values (ties: the higher)."""
    h = exp_hist.to(torch.int64).cpu()
    sums = torch.stack([h[lo + 1: lo + 1 + WINDOW].sum() for lo in range(0, MAX_LO + 1, 2)])
    best = int(sums.max())
    return 2 * int((sums == best).nonzero().max())


def _exponents(bits: torch.Tensor) -> torch.Tensor:
    return (bits.view(torch.int16).to(torch.int32) >> 7) & 0xFF


def _encode(bits: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of whole tiles (bf16 bits [16 t, K]) -> its data bytes, its escape entries and escapes a row."""
    n, k = bits.shape
    u = bits.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    c = ((u >> 7) & 0xFF) - lo
    inside = (c >= 1) & (c <= WINDOW)
    c = torch.where(inside, c, torch.zeros_like(c))
    low = (((c & 1) << 7) | (u & 0x7F)).to(torch.uint8)
    high = ((c >> 1) | ((u >> 8) & 0x80)).to(torch.uint8)  # sign << 7 | code >> 1
    del c
    nt, kc = n // TILE_ROWS, k // CHUNK_COLS
    # row = 16 tile + 8 h + g, column = 64 chunk + 16 t + 4 j + b; lane = 4 g + t
    planes = low.view(nt, 2, 8, kc, 4, 16).permute(0, 3, 1, 2, 4, 5).reshape(nt, kc, 2, 32, 16)
    hb = high.view(nt, 2, 8, kc, 4, 4, 4).permute(0, 3, 2, 4, 5, 6, 1)  # [tile, chunk, g, t, j, b, h]
    a, b = hb[..., 0], hb[..., 1]
    h_plane = a | ((b & 7) << 4) | (torch.roll(b >> 7, 1, dims=-1) << 3)  # byte b: b - 1's row g+8 sign at bit 3
    data = torch.cat([planes, h_plane.reshape(nt, kc, 1, 32, 16)], dim=2).reshape(-1)
    rows, cols = (~inside).nonzero(as_tuple=True)
    entry = (cols.to(torch.int64) << 16) | u[rows, cols].to(torch.int64)
    esc = torch.where(entry >= 1 << 31, entry - (1 << 32), entry).to(torch.int32)
    return data, esc, torch.bincount(rows, minlength=n)


def _assemble(shape: tuple[int, int], lo: int, blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
              ) -> FragmentWeight:
    counts = torch.cat([blk[2] for blk in blocks])
    rowptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    esc = torch.cat([blk[1] for blk in blocks])
    return FragmentWeight(shape, torch.cat([blk[0] for blk in blocks]).contiguous(), lo, rowptr, esc,
                          column_index(shape, rowptr, esc))


def _check(shape: tuple[int, ...]) -> tuple[int, int]:
    reason = unsupported(shape)
    if reason:
        raise ValueError(reason)
    return shape[0], shape[1]


def from_bits(bits: torch.Tensor) -> FragmentWeight:
    """bf16 bit patterns [N, K] (int16 or bfloat16) -> the fragment layout, on their device."""
    n, k = _check(tuple(bits.shape))
    lo = choose_lo(torch.bincount(_exponents(bits).reshape(-1), minlength=256))
    return _assemble((n, k), lo, [_encode(bits, lo)])


PASS_VALUES = 1 << 24  # values re-coded at a time from a resident weight: bounds a load's transient memory


def from_resident(r: object) -> FragmentWeight:
    """A resident weight (format/resident.py) in the fragment layout, on its device, a block of rows at a time."""
    from glyd_engine.format import resident

    n, k = _check(tuple(r.shape))
    step = max(TILE_ROWS, PASS_VALUES // k // TILE_ROWS * TILE_ROWS)
    spans = [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]

    def rows(a: int, b: int) -> torch.Tensor:
        return resident.decode_rows(r, torch.arange(a, b, device=r.sm.device)).view(torch.int16)

    hist = sum(torch.bincount(_exponents(rows(a, b)).reshape(-1), minlength=256) for a, b in spans)
    lo = choose_lo(hist)
    return _assemble((n, k), lo, [_encode(rows(a, b), lo) for a, b in spans])


def _entries(f: FragmentWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The escape list as (row, column, bf16 bits), int64."""
    rows = torch.repeat_interleave(torch.arange(f.shape[0], device=f.esc.device),
                                   (f.rowptr[1:] - f.rowptr[:-1]).to(torch.int64))
    entry = f.esc.to(torch.int64) & 0xFFFFFFFF
    return rows, entry >> 16, entry & 0xFFFF


def decode(f: FragmentWeight) -> torch.Tensor:
    """W in bf16 [N, K], bit for bit, by the kernel's arithmetic a byte at a time: an H word masked, and rotated by 4
    then masked, gives rows g and g + 8's high bytes; lo / 2 added to each; high and low bytes joined; escapes
    written over their places."""
    n, k = f.shape
    nt, kc = n // TILE_ROWS, k // CHUNK_COLS
    d = f.data.view(nt, kc, 3, 32, 16)
    hw = d[:, :, 2].view(nt, kc, 32, 4, 4)  # [tile, chunk, lane, j, byte]
    rot = (hw >> 4) | (torch.roll(hw, -1, dims=-1) << 4)  # the word rotated right by 4, byte by byte
    mask, add = HMASK & 0xFF, f.lo >> 1
    high = torch.stack([(hw & mask) + add, (rot & mask) + add], dim=2)  # [tile, chunk, h, lane, j, b], no carries
    bits = (high.reshape(nt, kc, 2, 32, 16).to(torch.int32) << 8) | d[:, :, :2].to(torch.int32)
    bits = bits.view(nt, kc, 2, 8, 4, 16).permute(0, 2, 3, 1, 4, 5).reshape(n, k)
    if f.esc.numel():
        rows, cols, true = _entries(f)
        bits[rows, cols] = true.to(torch.int32)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


def decode_rows(f: FragmentWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows of W (an embedding lookup), bf16 [len(rows), K], decoding only the 16-row tiles they fall in."""
    n, k = f.shape
    rows = rows.reshape(-1).to(torch.int64)
    tiles, where = torch.unique(rows // TILE_ROWS, return_inverse=True)
    data = f.data.view(n // TILE_ROWS, -1)[tiles].reshape(-1)
    sub_rows = (tiles[:, None] * TILE_ROWS + torch.arange(TILE_ROWS, device=rows.device)).reshape(-1)
    first = f.rowptr[:-1].to(torch.int64)[sub_rows]
    counts = f.rowptr[1:].to(torch.int64)[sub_rows] - first
    ends = counts.cumsum(0)
    total = int(ends[-1]) if ends.numel() else 0
    within = torch.arange(total, device=rows.device) - torch.repeat_interleave(ends - counts, counts)
    esc = f.esc[torch.repeat_interleave(first, counts) + within]
    rowptr = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    w = decode(FragmentWeight((len(tiles) * TILE_ROWS, k), data, f.lo, rowptr, esc))
    return w[where * TILE_ROWS + rows % TILE_ROWS]


def _f32(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (int64, 0..0xFFFF) as fp32 values."""
    b = bits << 16
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def matmul_reference(x: torch.Tensor, f: FragmentWeight) -> torch.Tensor:
    """x @ W.T in fp32 as the kernel computes it: W with escapes decoded as code 0 through the matmul, then
    x (true - decoded) added for each escape (the checks' model of the kernel, not a fast path)."""
    n, k = f.shape
    w = decode(FragmentWeight(f.shape, f.data, f.lo, torch.zeros_like(f.rowptr), f.esc[:0])).float()
    y = x.float() @ w.T
    if f.esc.numel():
        rows, cols, true = _entries(f)
        used = (true & 0x807F) | (f.lo << 7)
        delta = _f32(true) - _f32(used)
        y.index_add_(1, rows, x.float()[:, cols] * delta)
    return y
