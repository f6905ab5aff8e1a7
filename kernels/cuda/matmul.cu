// The Glyd matmul on NVIDIA GPUs (sm_80+): y = x W^T (+ bias) for 1-64 rows of x, W in the fragment-order weight
// code (docs/format.md section 4.1, glyd_engine/format/fragment_weight.py, the torch reference). Compiled at run time
// by NVRTC (kernels/nvrtc.py) with -D MT (8-row tiles of x: 1, 2, 4 or 8), NT (16-row tiles of W a block), WARPS (streaming
// warps a block), STAGES (chunks a warp holds in registers: one decoding, the rest in flight) and MIN_BLOCKS (blocks a
// multiprocessor: the register budget).
//
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate), lane = 4 g + t:  C^T = W·x^T,  A = 16 rows of W x 16 columns,
// B = x^T [16 columns x 8 rows of x].  A 64-column chunk of a 16-row tile is four k16 steps; in step j, the MMA's
// k slots 2t, 2t+1 hold columns 16 t + 4 j + {0, 1} and slots 2t+8, 2t+9 columns 16 t + 4 j + {2, 3} (the same
// permutation of k on both operands leaves the product alone). So a lane's A values of a chunk are rows g and g+8,
// columns 16 t .. 16 t + 15 (the layout stores them as one lane's three 16-byte loads), and its B values are 16
// consecutive columns of x row g (two 16-byte loads, no shuffle).
//
// Decoding, per step j: L words (a byte a value: the code's low bit << 7 | mantissa) of rows g and g + 8, and an H word
// whose byte b holds row g's sign and code >> 1 at bits {7, 2..0}, row g+8's code >> 1 at bits {6..4} and the sign of
// row g+8's value b+1 at bit 3 of byte b+1. One mask gives row g's high bytes, a rotate by 4 and the same mask row
// g+8's; adding lo / 2 to each byte makes them sign << 7 | exponent >> 1 (lo is even); a byte permute joins high and
// low bytes into two bf16 pairs. That is 9 integer instructions for 8 values. Escaped values carry code 0 (exponent lo,
// their own sign and mantissa); each row's list entry (column << 16 | the true bits) adds x (true - decoded).
//
// A block holds NT tiles of W (16 NT rows, the whole of K): its WARPS streaming warps take a share of K each, EW more
// warps walk the rows' escape lists (chains of dependent loads that would stall a streaming warp), and the warps'
// sums meet in shared memory, added in warp order: no partial sums leave the block, and a call gives the same bits on
// every run.

#include "fragment_code.cuh"

#ifndef MT
#define MT 1
#endif
#ifndef WARPS
#define WARPS 8  // streaming warps a block (EW more walk the escapes)
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#ifndef NT
#define NT 1  // 16-row tiles of W a warp streams side by side (they share x's registers)
#endif
#ifndef EW
#define EW 1  // escape warps a block: 1 walks rows g and g + 8 of each tile, 2 split them, 4 also split each list
#endif
#define HR (EW == 1 ? 2 : 1)        // rows of each tile a lane of an escape warp walks
#define PARTS (EW == 4 ? 2 : 1)     // escape warps sharing a row's list (entries part, part + PARTS, ...)
#ifndef EB
#define EB (MT == 1 ? 6 : MT == 2 ? 4 : 2)  // escape entries a row the escape warp loads at once
#endif
static_assert(MT == 1 || MT == 2 || MT == 4 || MT == 8, "1-8, 9-16, 17-32 or 33-64 rows of x");
static_assert((WARPS + EW) * NT * MT * 4 * 32 * 4 <= 48 * 1024, "the warps' sums fit static shared memory");
static_assert(STAGES >= 1 && STAGES <= 4, "1-4 chunks in registers");
static_assert(EW == 1 || EW == 2 || EW == 4, "one, two or four escape warps");

extern "C" __global__ void __launch_bounds__((WARPS + EW) * 32, MIN_BLOCKS) glyd_mm(
    u16* __restrict__ y, const uint4* __restrict__ w, const u16* __restrict__ x, const u16* __restrict__ bias,
    const int* __restrict__ rowptr, const u32* __restrict__ esc, int M, int N, int K, int ldx, int lo, int has_bias) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  const int chunks = K >> 6;
  const int tile0 = blockIdx.x * NT;
  __shared__ float red[WARPS + EW][NT * MT * 4][32];
  float acc[NT][MT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[n][mt][0] = acc[n][mt][1] = acc[n][mt][2] = acc[n][mt][3] = 0.f;

  if (warp < WARPS) {  // a share of K: chunks [c0, c1) of the block's NT tiles
    const int c0 = warp * chunks / WARPS, c1 = (warp + 1) * chunks / WARPS;
    const uint4* xp = reinterpret_cast<const uint4*>(x + size_t(g) * ldx) + 2 * t;  // row g; + 8 a chunk
    const size_t xrows8 = size_t(ldx);  // 16-byte units between rows g and g + 8 (8 rows of ldx bf16)
    const uint4* wp = w + size_t(tile0) * chunks * CHUNK_U4 + lane;
    const size_t tile_u4 = size_t(chunks) * CHUNK_U4;
    const u32 kb = u32(lo >> 1) * 0x01010101u;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 wb[STAGES][NT][3], xb[STAGES][2 * MT];
    auto load = [&](uint4(&ws)[NT][3], uint4(&xs)[2 * MT], int c) {
      if (c < c1) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint4* p = wp + n * tile_u4 + size_t(c) * CHUNK_U4;
          ws[n][0] = ld_stream(p);
          ws[n][1] = ld_stream(p + 32);
          ws[n][2] = ld_stream(p + 64);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const bool has = 8 * mt + g < M;
          xs[2 * mt] = has ? __ldg(xp + mt * xrows8 + 8 * c) : zero;
          xs[2 * mt + 1] = has ? __ldg(xp + mt * xrows8 + 8 * c + 1) : zero;
        }
      }
    };
#pragma unroll
    for (int s = 0; s < STAGES; ++s) load(wb[s], xb[s], c0 + s);
    for (int c = c0; c < c1; c += STAGES) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) {
        if (c + s < c1) {
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              u32 a0, a1, a2, a3;
              decode_step(word(wb[s][n][0], j), word(wb[s][n][1], j), word(wb[s][n][2], j), kb, a0, a1, a2, a3);
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                const uint4& xv = xb[s][2 * mt + (j >> 1)];
                mma(acc[n][mt], a0, a1, a2, a3, word(xv, (2 * j) & 3), word(xv, (2 * j + 1) & 3));
              }
            }
          load(wb[s], xb[s], c + s + STAGES);
        }
      }
    }
  } else {  // escape warps: x (true - decoded) for every escape of the block's rows, each row's list in order
    const int h0 = EW == 1 ? 0 : (warp - WARPS) & 1;  // this warp's rows of each tile: g + 8 h for h in [h0, h0 + HR)
    const int part = EW == 4 ? (warp - WARPS) >> 1 : 0;
    float cacc[NT][MT][HR][2];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < HR; ++hh) cacc[n][mt][hh][0] = cacc[n][mt][hh][1] = 0.f;
#pragma unroll 1
    for (int n = 0; n < NT; ++n) {
      int e[HR], e1[HR];
#pragma unroll
      for (int hh = 0; hh < HR; ++hh) {
        const int row = 16 * (tile0 + n) + g + 8 * (h0 + hh);
        e[hh] = __ldg(rowptr + row) + part;
        e1[hh] = __ldg(rowptr + row + 1);
      }
      u32 en[HR][EB];
#pragma unroll
      for (int hh = 0; hh < HR; ++hh)
#pragma unroll
        for (int q = 0; q < EB; ++q) en[hh][q] = e[hh] + PARTS * q < e1[hh] ? __ldg(esc + e[hh] + PARTS * q) : 0u;
      // one batch of EB entries a row a round trip: its x values load with the next batch's entries
      while (e[0] < e1[0] || e[HR - 1] < e1[HR - 1]) {
        float xv[HR][EB][MT][2];
        u32 nx[HR][EB];
#pragma unroll
        for (int hh = 0; hh < HR; ++hh)
#pragma unroll
          for (int q = 0; q < EB; ++q) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const int m = 8 * mt + 2 * t + r;
                xv[hh][q][mt][r] =
                    e[hh] + PARTS * q < e1[hh] && m < M ? bf(__ldg(x + size_t(m) * ldx + (en[hh][q] >> 16))) : 0.f;
              }
            const int ne = e[hh] + PARTS * (EB + q);
            nx[hh][q] = ne < e1[hh] ? __ldg(esc + ne) : 0u;
          }
#pragma unroll
        for (int hh = 0; hh < HR; ++hh)
#pragma unroll
          for (int q = 0; q < EB; ++q) {
            const float tv = bf(en[hh][q] & 0xFFFFu), dv = bf((en[hh][q] & 0x807Fu) | (u32(lo) << 7));
            if (e[hh] + PARTS * q < e1[hh]) {
#pragma unroll
              for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r)
                  cacc[n][mt][hh][r] = fmaf(tv, xv[hh][q][mt][r], fmaf(-dv, xv[hh][q][mt][r], cacc[n][mt][hh][r]));
            }
            en[hh][q] = nx[hh][q];
          }
#pragma unroll
        for (int hh = 0; hh < HR; ++hh) e[hh] += PARTS * EB;
      }
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < HR; ++hh)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (h == h0 + hh) acc[n][mt][2 * h] = cacc[n][mt][hh][0], acc[n][mt][2 * h + 1] = cacc[n][mt][hh][1];
  }

  // the warps' sums, added in warp order: C[g + 8h][2t + r] of (tile n, x-row tile mt) is y[8 mt + 2t + r][16 tile + g + 8h]
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][(n * MT + mt) * 4 + i][lane] = acc[n][mt][i];
  __syncthreads();
  for (int idx = threadIdx.x; idx < NT * MT * 4 * 32; idx += (WARPS + EW) * 32) {
    const int i = idx >> 5, ln = idx & 31;
    const int n = i / (MT * 4), mt = (i / 4) % MT, q = i & 3;
    const int m = 8 * mt + 2 * (ln & 3) + (q & 1), row = 16 * (tile0 + n) + (ln >> 2) + 8 * (q >> 1);
    if (m >= M) continue;
    float v = 0.f;
#pragma unroll
    for (int wi = 0; wi < WARPS + EW; ++wi) v += red[wi][i][ln];
    y[size_t(m) * N + row] = to_bf16(v + (has_bias ? bf(bias[row]) : 0.f));
  }
}

// W in bf16 [N, K], escapes as decoded (code 0): a warp a (tile, chunk). glyd_mm_patch then writes the escapes.
extern "C" __global__ void __launch_bounds__(128) glyd_mm_decode(u16* __restrict__ out, const uint4* __restrict__ w,
                                                                 int N, int K, int lo) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int chunks = K >> 6;
  const long long unit = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
  if (unit >= (long long)(N >> 4) * chunks) return;
  const int tile = int(unit / chunks), c = int(unit % chunks);
  const uint4* p = w + size_t(unit) * CHUNK_U4 + lane;
  const uint4 l0 = ld_stream(p), l1 = ld_stream(p + 32), hw = ld_stream(p + 64);
  const u32 kb = u32(lo >> 1) * 0x01010101u;
  u32 r0[8], r1[8];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    decode_step(word(l0, j), word(l1, j), word(hw, j), kb, r0[2 * j], r1[2 * j], r0[2 * j + 1], r1[2 * j + 1]);
  uint4* o0 = reinterpret_cast<uint4*>(out + size_t(16 * tile + g) * K + 64 * c + 16 * t);
  uint4* o1 = reinterpret_cast<uint4*>(out + size_t(16 * tile + g + 8) * K + 64 * c + 16 * t);
  o0[0] = make_uint4(r0[0], r0[1], r0[2], r0[3]);
  o0[1] = make_uint4(r0[4], r0[5], r0[6], r0[7]);
  o1[0] = make_uint4(r1[0], r1[1], r1[2], r1[3]);
  o1[1] = make_uint4(r1[4], r1[5], r1[6], r1[7]);
}

extern "C" __global__ void __launch_bounds__(128) glyd_mm_patch(u16* __restrict__ out, const int* __restrict__ rowptr,
                                                                const u32* __restrict__ esc, int N, int K) {
  const int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= N) return;
  for (int e = rowptr[row] + lane; e < rowptr[row + 1]; e += 32) {
    const u32 en = esc[e];
    out[size_t(row) * K + (en >> 16)] = u16(en & 0xFFFFu);
  }
}

// Rows ids[m] of W in bf16 [M, K], escapes patched (an embedding lookup: no whole-table decode, no host sync). A block
// a row: each thread decodes a (chunk, lane t) share of its tile (the three 16-byte loads of lane 4 g + t hold rows g
// and g + 8 of 16 columns), keeps the row's half, then the block writes the row's escapes. Ids outside [0, N) give
// zero rows.
extern "C" __global__ void __launch_bounds__(128) glyd_mm_gather(u16* __restrict__ out, const uint4* __restrict__ w,
                                                                 const long long* __restrict__ ids,
                                                                 const int* __restrict__ rowptr,
                                                                 const u32* __restrict__ esc, int N, int K, int lo) {
  const long long id = ids[blockIdx.x];
  u16* o = out + size_t(blockIdx.x) * K;
  const int chunks = K >> 6;
  if (id < 0 || id >= N) {
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) reinterpret_cast<uint4*>(o)[i] = make_uint4(0, 0, 0, 0);
    return;
  }
  const int tile = int(id >> 4), g = int(id & 7), upper = int((id >> 3) & 1);
  const u32 kb = u32(lo >> 1) * 0x01010101u;
  for (int i = threadIdx.x; i < 4 * chunks; i += blockDim.x) {
    const int c = i >> 2, t = i & 3;
    const uint4* p = w + (size_t(tile) * chunks + c) * CHUNK_U4 + 4 * g + t;
    const uint4 l0 = ld_stream(p), l1 = ld_stream(p + 32), hw = ld_stream(p + 64);
    u32 r0[8], r1[8];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      decode_step(word(l0, j), word(l1, j), word(hw, j), kb, r0[2 * j], r1[2 * j], r0[2 * j + 1], r1[2 * j + 1]);
    uint4* dst = reinterpret_cast<uint4*>(o + 64 * c + 16 * t);
    const u32* r = upper ? r1 : r0;
    dst[0] = make_uint4(r[0], r[1], r[2], r[3]);
    dst[1] = make_uint4(r[4], r[5], r[6], r[7]);
  }
  __syncthreads();
  for (int e = rowptr[id] + threadIdx.x; e < rowptr[id + 1]; e += blockDim.x) {
    const u32 en = esc[e];
    o[en >> 16] = u16(en & 0xFFFFu);
  }
}
