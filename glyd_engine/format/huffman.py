"""Length-limited canonical prefix codes over the 256 exponents, with vectorized torch encode/decode.

The stream is a sequence of 32-bit words, codes packed MSB-first. Values are cut into chunks of
`chunk` values; `offsets[i]` is the bit where chunk i starts, so chunks decode independently and in
lockstep (one lane per chunk): the same loop a GPU kernel runs, one peek + one table lookup a value.
"""

from __future__ import annotations

import heapq

import torch

MAX_CODE_LEN = 12  # decode table of 2**12 entries: small enough to sit on chip


def code_lengths(counts: torch.Tensor, max_len: int = MAX_CODE_LEN) -> torch.Tensor:
    """Huffman code lengths (uint8[256], 0 = symbol absent), no longer than `max_len`."""
    freq = [int(c) for c in counts.tolist()]
    if len(freq) != 256:
        raise ValueError("expected 256 counts")
    present = [s for s in range(256) if freq[s] > 0]
    lengths = [0] * 256
    if not present:
        return torch.zeros(256, dtype=torch.uint8)
    if len(present) == 1:
        lengths[present[0]] = 1
        return torch.tensor(lengths, dtype=torch.uint8)
    while True:
        heap = [(freq[s], s, (s,)) for s in present]
        heapq.heapify(heap)
        depth = dict.fromkeys(present, 0)
        tie = 256
        while len(heap) > 1:
            fa, _, sa = heapq.heappop(heap)
            fb, _, sb = heapq.heappop(heap)
            for s in sa + sb:
                depth[s] += 1
            heapq.heappush(heap, (fa + fb, tie, sa + sb))
            tie += 1
        if max(depth.values()) <= max_len:
            break
        # Flatten the distribution and retry: costs a hair of ratio on extreme tails only.
        freq = [(f + 1) // 2 if f > 0 else 0 for f in freq]
    for s, d in depth.items():
        lengths[s] = d
    return torch.tensor(lengths, dtype=torch.uint8)


def canonical_codes(lengths: torch.Tensor) -> torch.Tensor:
    """Canonical code of each symbol (int64[256]), assigned in (length, symbol) order."""
    lens = [int(x) for x in lengths.tolist()]
    codes = [0] * 256
    code = 0
    prev = 0
    for length, sym in sorted((ln, s) for s, ln in enumerate(lens) if ln > 0):
        code <<= length - prev
        codes[sym] = code
        code += 1
        prev = length
    if prev and code > (1 << prev):
        raise ValueError("code lengths violate the Kraft inequality")
    return torch.tensor(codes, dtype=torch.int64)


def check_lengths(lengths: torch.Tensor) -> None:
    """Reject tables that cannot come from `code_lengths` (a corrupt file must not decode to garbage)."""
    if lengths.dtype != torch.uint8 or lengths.numel() != 256:
        raise ValueError("a code-length table is 256 uint8 values")
    lens = lengths.to(torch.int64)
    if int(lens.max()) > MAX_CODE_LEN:
        raise ValueError("code length over the limit")
    kraft = sum(1 << (MAX_CODE_LEN - int(x)) for x in lens.tolist() if x > 0)
    if kraft > (1 << MAX_CODE_LEN):
        raise ValueError("code lengths violate the Kraft inequality")


def decode_table(lengths: torch.Tensor) -> torch.Tensor:
    """int32[2**MAX_CODE_LEN]: entry = symbol | length << 8 for every MAX_CODE_LEN-bit window."""
    check_lengths(lengths)
    codes = canonical_codes(lengths)
    table = torch.zeros(1 << MAX_CODE_LEN, dtype=torch.int32)
    for sym in range(256):
        ln = int(lengths[sym])
        if ln == 0:
            continue
        start = int(codes[sym]) << (MAX_CODE_LEN - ln)
        table[start : start + (1 << (MAX_CODE_LEN - ln))] = sym | (ln << 8)
    return table


_POW2 = torch.tensor([1 << k if k < 63 else -(1 << 63) for k in range(64)], dtype=torch.int64)


def _to_int32_words(words64: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits in int32."""
    return torch.where(words64 >= (1 << 31), words64 - (1 << 32), words64).to(torch.int32)


def encode(symbols: torch.Tensor, lengths: torch.Tensor, chunk: int,
           slice_values: int = 1 << 22) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode uint8 symbols (flat) -> (words int32[m], offsets int64[n_chunks + 1]).

    Works in slices of `slice_values` so peak memory stays a few bytes a value whatever the tensor size.
    """
    sym = symbols.reshape(-1)
    n = sym.numel()
    lens_tab = lengths.to(torch.int64)
    codes_tab = canonical_codes(lengths)
    hist = torch.bincount(sym.to(torch.int64), minlength=256)
    if bool(((hist > 0) & (lens_tab == 0)).any()):
        raise ValueError("a symbol has no code in this table")
    total_bits = int((hist * lens_tab).sum())
    words = torch.zeros(total_bits // 32 + 2, dtype=torch.int64)
    n_chunks = (n + chunk - 1) // chunk
    offsets = torch.empty(n_chunks + 1, dtype=torch.int64)
    slice_values = max(chunk, slice_values - slice_values % chunk)
    base = 0
    for start in range(0, n, slice_values):
        s = sym[start : start + slice_values].to(torch.int64)
        ln = lens_tab[s]
        cd = codes_tab[s]
        pos = torch.cumsum(ln, 0) - ln + base
        first = start // chunk
        offsets[first : first + (s.numel() + chunk - 1) // chunk] = pos[::chunk]
        w = pos >> 5
        # The code placed in a 64-bit window at word w; a multiply by 2**k (wrapping) is a left shift,
        # and several times faster than torch's shift by a tensor on the CPU.
        shifted = cd * _POW2[64 - (pos & 31) - ln]
        # int64 is signed: take the high word with a logical shift.
        high = (shifted >> 32) & 0xFFFFFFFF
        low = shifted & 0xFFFFFFFF
        words.scatter_add_(0, w, high)
        words.scatter_add_(0, w + 1, low)
        base = int(pos[-1] + ln[-1])
    offsets[n_chunks] = base
    return _to_int32_words(words), offsets


def decode(words: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, n: int, chunk: int,
           lanes: int = 1 << 14) -> torch.Tensor:
    """Inverse of `encode`: uint8[n]. `lanes` chunks decode together (bounded memory)."""
    n_chunks = offsets.numel() - 1
    if n_chunks != (n + chunk - 1) // chunk:
        raise ValueError("offsets do not match the value count")
    return decode_chunks(words, offsets, lengths, torch.arange(n_chunks), chunk, lanes)[:n]


def decode_chunks(words: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, chunks: torch.Tensor, chunk: int,
                  lanes: int = 1 << 14) -> torch.Tensor:
    """The symbols of the chunks numbered `chunks` only (ascending or not), uint8[len(chunks) * chunk]: a shard of
    a tensor decodes the chunks that hold it and no other. A last, partial chunk's tail past the stream is junk."""
    table = decode_table(lengths).to(torch.int64)
    w64 = words.to(torch.int64) & 0xFFFFFFFF
    # pair[i] = words i and i+1 as one 64-bit window: one gather a step instead of two.
    pair = (w64 << 32) | torch.cat([w64[1:], torch.zeros(1, dtype=torch.int64)])
    last = pair.numel() - 1
    starts = offsets.to(torch.int64)[chunks.to(torch.int64)]
    out = torch.empty(starts.numel() * chunk, dtype=torch.uint8)
    mask = (1 << MAX_CODE_LEN) - 1
    for c0 in range(0, starts.numel(), lanes):
        pos = starts[c0 : c0 + lanes].clone()
        steps = []
        for _ in range(chunk):
            window = pair[torch.clamp(pos >> 5, max=last)]
            entry = table[(window >> (64 - MAX_CODE_LEN - (pos & 31))) & mask]
            steps.append(entry)
            pos += entry >> 8
        block = (torch.stack(steps, dim=1) & 0xFF).to(torch.uint8)
        out[c0 * chunk : c0 * chunk + block.numel()] = block.reshape(-1)
    return out
