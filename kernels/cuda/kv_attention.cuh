// Decode attention over page code v3 (kv_decode_attention), the merge of its context splits (kv_merge) and the tile
// reader (kv_read_tiles). Included by kv_pages.cu after kv_code.cuh; docs/gpu.md, "Decode attention".
//
// Fragments (mma.sync.m16n8k16, bf16 in, fp32 accumulate); lane = 4 g + tig:
//   S^T = K'·Q'^T   A = K' [16 tokens x 16 channels],   B = Q'^T [16 channels x 8 query heads (>= GQ zero)]
//   O^T = V'^T·P^T  A = V'^T [16 channels x 16 tokens], B = P^T [16 tokens x 8 heads]
// Each half of the S^T accumulator is the m8n8 fragment of P^T's transpose: one movmatrix each turns it into P^T's
// B fragment, so probabilities never leave registers. K' and V' are the values scaled by 2^(127 - top) per channel (the
// pages store them so: exponent 120 + c); Q' = Q 2^(top_k - 127) makes S exact, O^T is scaled back at the end.
#pragma once
#include "kv_code.cuh"

// ---- build switches: each a product choice (docs/gpu.md, "Defaults and why"); kernels/kv_cuda.py passes them ----
#ifndef RING
#define RING 2  // decode's tile pipeline: N >= 2, an N-slot ring a warp in shared memory; 0, two register buffers
#endif
#ifndef BULK
#define BULK 1  // on sm_90+ the ring is filled by bulk copies (one instruction a tile), else by 16-byte cp.async a lane
#endif
#ifndef PATCH
#define PATCH (GQ <= 4)  // ring builds: escapes patched into the operands (below); the per-warp smem fits 3 blocks
#endif
#if RING && PATCH
#define RING_PATCH 1
#else
#define RING_PATCH 0
#endif
#if RING && BULK && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define RING_BULK 1
#else
#define RING_BULK 0
#endif
#ifndef P_SPLIT
// 1: P·V as two bf16 MMAs (P's bf16 value and its remainder), P to ~2^-17 instead of 2^-9: attention error below
// vLLM's kernel's for 0-1.3% of the 4-bit code's time; up to 6% of the 3-bit code's, whose tiles cost more already
#define P_SPLIT (CB == 4)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 3  // decode blocks a multiprocessor: sets the register budget (65536 / (MIN_BLOCKS * WARPS * 32))
#endif
#define NEG_INF (-__int_as_float(0x7f800000))
#define MERGE_SPLITS 64  // the most splits the decode launch merges itself (two a lane); kv_merge takes more

static_assert(GQ >= 1 && GQ <= 8, "1..8 query heads a KV head");

__device__ __forceinline__ float pow2(int e) { return __uint_as_float(u32(e + 127) << 23); }  // 2^e, |e| < 127

// One tile's registers for decode attention: K and V planes, the trailer, this lane's first K and V list entry.
struct Buf {
  Planes k, v;
  uint2 tr;
  u32 ek, ev;
  long blk;
};

// A tile's registers from its bytes at tp: global memory (SH false) or its ring slot in shared memory (SH true).
template <bool SH>
__device__ __forceinline__ void load_buf(Buf& b, const u8* tp, int lane) {
  load_planes<SH>(b.k, tp + lane * 16, tp + lane * 8, tp + lane * 4, K_L, K_H);
  load_planes<SH>(b.v, tp + lane * 16, tp + lane * 8, tp + lane * 4, V_L, V_H);
  b.tr = ld8<SH>(tp + TR);
  const u8* l2 = tp + LIST + lane * 2;
  b.ek = lane < RESERVE ? ld2<SH>(l2) : 0u;
  b.ev = lane < RESERVE ? ld2<SH>(l2 + 2 * (RESERVE - 1) - 4 * lane) : 0u;
}

// Adds add[hh] to row[hh * STRIDE + key] for each lane with an entry, without atomics: lanes sharing a key take
// turns (their rank among the lanes with that key), so each turn writes distinct addresses. Ends with the warp
// converged and its writes visible to the warp.
template <int STRIDE>
__device__ __forceinline__ void accumulate(float* row, int key, const float (&add)[GQ], bool ok, int lane) {
  const u32 peers = __match_any_sync(FULL, key);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  const int turns = __reduce_max_sync(FULL, u32(rank));
  for (int r = 0; r <= turns; ++r) {
    if (ok && rank == r) {
#pragma unroll
      for (int hh = 0; hh < GQ; ++hh) row[hh * STRIDE + key] += add[hh];
    }
    __syncwarp();
  }
}

// An escape patched into its operand: the fast path decodes exponent e_c (the window's, scaled domain) where the
// value's own exponent, scaled by 2^(127 - top), is e_s; the operand gets e_s by XORing e_c ^ e_s in: its low bit
// in the L byte (written back into the slot's L plane), the other seven in the H byte (a plane of XOR bytes laid out
// like the L plane). Exact where the scaled value is a normal bf16, a zero, an inf or a NaN; false otherwise (the
// tile then takes the corrections).
// packed: L offset | XOR H bits << 11 | new L byte << 18 | 1 << 31.
template <bool SH>
__device__ __forceinline__ bool patch_of(const u8* tile, u32 e, int kind, const u8 (&tops)[2][D], u32& packed) {
  const Escape x = locate<SH>(tile, e, kind);
  const int et = int((x.truth >> 7) & 0xFFu), top = tops[kind][x.d];
  const bool zero = (x.truth & 0x7Fu) == 0u;
  int es = et + 127 - top;
  bool exact = es >= 1 && es <= 254;
  if (et == 255) es = 255, exact = true;                                 // inf, NaN
  if (et == 0) es = 0, exact = zero || top == 127;                       // zero; a subnormal only unscaled
  const u32 xr = (((x.wrong >> 7) & 0xFFu) ^ u32(es)) & 0xFFu;
  packed = (e & (LP - 1)) | ((xr >> 1) << 11) | (((x.wrong & 0xFFu) ^ ((xr & 1u) << 7)) << 18) | 0x80000000u;
  return exact;
}

// ================================================================================================================
// Decode attention: one query token a sequence. Grid (splits, KV heads, sequences); WARPS warps a block, each
// taking every WARPS-th tile of the block's share of the sequence, with its own online softmax; the block then
// combines its warps; with several splits the last block of a (sequence, KV head) to finish merges its splits in a
// fixed order (a counter a pair), or `kv_merge` does in a second launch.
// ================================================================================================================
struct Smem {
#if RING
  __align__(16) u8 ring[WARPS][RING][TILE_BYTES];  // each warp's tiles in flight
  long slot_blk[WARPS][RING];                      // their blocks
  u64 bar[WARPS][RING];                            // bulk copies: each slot's bytes arrived
#endif
  u32 qq[D][8];     // [channel][head] bf16 pairs: Q (low half) and Q' = Q 2^(top_k - 127) as the MMA takes it (high
                    // half); heads >= GQ zero
  float vsc[D];     // 2^(top_v - 127): V' back to V
  float pst[WARPS][8][16];
  float ocorr[WARPS][GQ][D];
#if RING_PATCH
  u8 tops[2][D];    // the K and V window tops: an escape's exponent in the scaled domain
#endif
  float wm[WARPS][8], wl[WARPS][8];
  int last_split;   // this block finished its (sequence, KV head)'s splits last: it merges them
};

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) kv_decode_attention(
    const u16* __restrict__ query, u16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    const u8* __restrict__ cache, const u8* __restrict__ tops, const int* __restrict__ ovf_ptr,
    const long long* __restrict__ arena_ref, const int* __restrict__ block_table, const int* __restrict__ seq_lens,
    float scale_log2, int stride_q0, int stride_q1, int stride_o0, int stride_o1, int bt_stride, int num_kv_heads,
    int num_splits, long long block_stride, long long head_stride, int* __restrict__ split_count) {
  extern __shared__ __align__(16) u8 smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int split = blockIdx.x, h = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int seq_len = seq_lens[seq];
  const int n_tiles = (seq_len + 15) >> 4;
  // each sequence's splits share its own tiles: any split count serves any length (a captured graph fixes it)
  const int tiles_per_split = (n_tiles + num_splits - 1) / num_splits;
  const int t_begin = split * tiles_per_split;
  const int t_end = min(n_tiles, t_begin + tiles_per_split);

  const u8* head_base = cache + h * head_stride;  // pages at vLLM's strides (bytes), padded or interleaved
  const int* bt = block_table + (long)seq * bt_stride;

  Buf b0;
#if !RING
  Buf b1;
#endif
  int blk_lane = 0;  // block id of this warp's tile k0 + lane, for 32 tiles at a time
  auto block_of = [&](int kk) -> long {  // the warp's kk-th tile (kk increasing, all lanes together)
    if ((kk & 31) == 0) {
      const int tl = t_begin + warp + (kk + lane) * WARPS;
      blk_lane = tl < t_end ? __ldg(bt + tl / TPP) : 0;
    }
    return (long)__shfl_sync(FULL, blk_lane, kk & 31);
  };
  auto tile_ptr = [&](long blk, int tl) -> const u8* {
    return head_base + blk * block_stride + (tl % TPP) * TILE_BYTES;
  };
#if !RING
  auto fetch = [&](Buf& bf_, int kk, int tl) {
    bf_.blk = block_of(kk);
    load_buf<false>(bf_, tile_ptr(bf_.blk, tl), lane);
  };
#endif

  constexpr bool SH = RING > 0;
#if RING
  // tile kk of this warp (tl) into ring slot kk % RING: a bulk copy issued by lane 0 (sm_90+), else 16-byte
  // cp.async a lane at compile-time offsets and one commit group a call, copies or not
#if RING_BULK
  if (lane < RING) mbar_init(smem_u32(&sm.bar[warp][lane]), 1);
  mbar_init_visible();
  __syncwarp();
#endif
  auto issue = [&](int kk, int tl) {
    if (tl < t_end) {
      const long blk = block_of(kk);
      const u8* src = tile_ptr(blk, tl);
      u8* dst = &sm.ring[warp][kk % RING][0];
      if (lane == 0) sm.slot_blk[warp][kk % RING] = blk;
#if RING_BULK
      if (lane == 0) {  // the slot's mbarrier counts the copy's bytes
        const u32 bar = smem_u32(&sm.bar[warp][kk % RING]);
        mbar_arrive_expect_tx(bar, TILE_BYTES);
        cp_bulk(smem_u32(dst), src, TILE_BYTES, bar);
      }
#else
      constexpr int CHUNKS = TILE_BYTES / 16;
      src += 16 * lane;
      dst += 16 * lane;
#pragma unroll
      for (int c = 0; c < CHUNKS / 32; ++c) cp16(dst + 512 * c, src + 512 * c);
      if (CHUNKS % 32 && lane < CHUNKS % 32) cp16(dst + 512 * (CHUNKS / 32), src + 512 * (CHUNKS / 32));
#endif
    }
#if !RING_BULK
    cp_commit();
#endif
  };
  // The first tiles' bytes are in flight while Q is set up.
  for (int kk = 0; kk < RING - 1; ++kk) issue(kk, t_begin + warp + kk * WARPS);
#else
  // The first tile's bytes are in flight while Q is set up.
  int tile = t_begin + warp, kk = 0;
  if (tile < t_end) fetch(b0, 0, tile);
#endif

  // Q of the KV head's query heads, 8 channels (16 bytes) a thread: one round of loads (query rows 16-byte aligned)
  for (int i = threadIdx.x; i < 8 * (D / 8); i += WARPS * 32) {
    const int hh = i / (D / 8), d0 = 8 * (i % (D / 8));
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    uint2 tw = make_uint2(0u, 0u);
    if (hh < GQ) {
      raw = *reinterpret_cast<const uint4*>(query + (long)seq * stride_q0 + (long)(h * GQ + hh) * stride_q1 + d0);
      tw = *reinterpret_cast<const uint2*>(tops + h * D + d0);
    }
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float qv = bf((w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu);
      const int top = int(((j < 4 ? tw.x : tw.y) >> (8 * (j & 3))) & 0xFFu);
      const float qp = hh < GQ ? bf(pack_bf16(qv * pow2(top - 127), 0.f) & 0xFFFFu) : 0.f;
      sm.qq[d0 + j][hh] = pack_bf16(qv, qp);
    }
  }
  for (int d = threadIdx.x; d < D; d += WARPS * 32) sm.vsc[d] = pow2(int(tops[(num_kv_heads + h) * D + d]) - 127);
  for (int i = lane; i < GQ * D; i += 32) (&sm.ocorr[warp][0][0])[i] = 0.f;
#if RING_PATCH
  for (int i = threadIdx.x; i < 2 * D; i += WARPS * 32)
    sm.tops[i / D][i % D] = tops[((i / D) * num_kv_heads + h) * D + i % D];
#endif
  __syncthreads();

  u32 qb0[D / 16], qb1[D / 16];  // Q'^T's B fragments: head g, channels 16ks + 2tig + {0, 1} and + {8, 9}
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const int c = 16 * ks + 2 * tig;
    qb0[ks] = prmt(sm.qq[c][g], sm.qq[c + 1][g], 0x7632);
    qb1[ks] = prmt(sm.qq[c + 8][g], sm.qq[c + 9][g], 0x7632);
  }

  float o[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {NEG_INF, NEG_INF}, l_part[2] = {0.f, 0.f};  // heads 2tig, 2tig + 1
  bool ocorr_used = false;

  // tp: the tile's bytes (global memory, or its ring slot) for the escape entries. Patched (a ring slot whose
  // escapes prepare_patches has patched): the operands' exponent fixes are XORed in, no corrections.
  auto process = [&](const Buf& cb, int tile, const u8* tp, const bool PATCHED) {  // a literal: inlined twice
    const long gtile = cb.blk * TPP + tile % TPP;
    const int nk_tot = PATCHED ? 0 : cb.tr.x & 0xFFFF, nv_tot = PATCHED ? 0 : cb.tr.x >> 16;
    const int nk_in = cb.tr.y & 0xFFFF, nv_in = cb.tr.y >> 16;
    u32 k_vals = 0u, k_where = 0xFFu;  // this lane's K entry: true | -decoded << 16; token | channel << 8
    if (lane < nk_tot) {
      const u32 e = lane < nk_in ? cb.ek : entry_at<SH>(tp, lane, nk_in, 0, ovf_ptr, arena_ref, gtile, h, num_kv_heads);
      const Escape x = locate<SH>(tp, e, 0);
      k_vals = x.truth | ((x.wrong ^ 0x8000u) << 16);  // the decoded value enters negated
      k_where = u32(x.t) | (u32(x.d) << 8);
    }
    int v_d = 0, v_t = 0;
    float v_delta = 0.f;
    if (lane < nv_tot) {  // this lane's V entry, located now: its loads overlap the K work
      const u32 e = lane < nv_in ? cb.ev : entry_at<SH>(tp, lane, nv_in, 1, ovf_ptr, arena_ref, gtile, h, num_kv_heads);
      const Escape x = locate<SH>(tp, e, 1);
      v_d = x.d;
      v_t = x.t;
      v_delta = bf(x.truth) - bf(x.wrong) * sm.vsc[x.d];
    }
    // ---- S^T = K'·Q'^T over the tile's 16 tokens: st[c] = S[head 2tig + (c & 1)][token g + 8 (c >> 1)] ----
    float st[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      u32 H0 = hbytes(cb.k.h, 2 * ks), H1 = hbytes(cb.k.h, 2 * ks + 1);
      if (PATCHED) {  // the exponent fixes' H bits, in the slot where K's L plane was
        const uint2 x = ld8<true>(tp + K_L + lane * 16 + (ks >> 1) * 512 + 8 * (ks & 1));
        H0 ^= x.x;
        H1 ^= x.y;
      }
      const u32 L0 = cb.k.l[2 * ks], L1 = cb.k.l[2 * ks + 1];
      mma(st, prmt(L0, H0, 0x5140), prmt(L1, H1, 0x5140), prmt(L0, H0, 0x7362), prmt(L1, H1, 0x7362), qb0[ks],
          qb1[ks]);
    }
    if (nk_tot) {
      // K escapes: S^T[t][h] += sum_e [t_e = t] (K_e Q[h][d_e] - K'_e Q'[h][d_e]), as two MMAs a 16 entries whose A
      // operands hold each entry's value in its token's row and whose B operands gather Q at the entries' channels.
      for (int base = 0; base < nk_tot; base += 32) {
        const int i = base + lane;
        u32 vals = k_vals, where = k_where;  // token 0xFF: no entry
        if (base > 0) {
          vals = 0u;
          where = 0xFFu;
          if (i < nk_tot) {
            const Escape x = locate<SH>(tp, entry_at<SH>(tp, i, nk_in, 0, ovf_ptr, arena_ref, gtile, h, num_kv_heads), 0);
            vals = x.truth | ((x.wrong ^ 0x8000u) << 16);
            where = u32(x.t) | (u32(x.d) << 8);
          }
        }
        const bool two = base + 16 < nk_tot;  // warp-uniform
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (c == 1 && !two) break;
          u32 tv[4], wv[4], qv[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // entries 16c + 2tig + {0, 1, 8, 9}
            const int src = 16 * c + 2 * tig + (j & 1) + 8 * (j >> 1);
            const u32 vv = __shfl_sync(FULL, vals, src), ww = __shfl_sync(FULL, where, src);
            const u32 t = ww & 0xFFu;
            tv[j] = vv;
            wv[j] = t;
            qv[j] = t == 0xFFu ? 0u : sm.qq[ww >> 8][g];  // Q and Q' at the entry's channel, head g
          }
          u32 ta[4], wa[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) {  // a0..a3: rows g (r even) / g + 8 (r odd), entries {0,1} (r < 2) / {2,3}
            const int j0 = 2 * (r >> 1), row = g + 8 * (r & 1);
            const u32 lo = wv[j0] == u32(row) ? tv[j0] : 0u, hi = wv[j0 + 1] == u32(row) ? tv[j0 + 1] : 0u;
            ta[r] = prmt(lo, hi, 0x5410);
            wa[r] = prmt(lo, hi, 0x7632);
          }
          mma(st, ta[0], ta[1], ta[2], ta[3], prmt(qv[0], qv[1], 0x5410), prmt(qv[2], qv[3], 0x5410));
          mma(st, wa[0], wa[1], wa[2], wa[3], prmt(qv[0], qv[1], 0x7632), prmt(qv[2], qv[3], 0x7632));
        }
      }
    }

    // ---- online softmax (log2 domain), rescaled only when a head's max grows by more than 2^8 ----
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int hh = 2 * tig + (c & 1), tok = tile * 16 + g + 8 * (c >> 1);
      st[c] = (hh < GQ && tok < seq_len) ? st[c] * scale_log2 : NEG_INF;
      mx[c & 1] = fmaxf(mx[c & 1], st[c]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      mx[j] = fmaxf(mx[j], __shfl_xor_sync(FULL, mx[j], 4));
      mx[j] = fmaxf(mx[j], __shfl_xor_sync(FULL, mx[j], 8));
      mx[j] = fmaxf(mx[j], __shfl_xor_sync(FULL, mx[j], 16));
    }
    if (__any_sync(FULL, mx[0] > m_run[0] + 8.f || mx[1] > m_run[1] + 8.f)) {
      float alpha[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float m_new = fmaxf(m_run[j], mx[j]);
        alpha[j] = m_new == NEG_INF ? 1.f : ex2(m_run[j] - m_new);
        l_part[j] *= alpha[j];
        m_run[j] = m_new;
      }
#pragma unroll
      for (int mb = 0; mb < D / 16; ++mb) {
        o[mb][0] *= alpha[0]; o[mb][1] *= alpha[1]; o[mb][2] *= alpha[0]; o[mb][3] *= alpha[1];
      }
      if (ocorr_used) {
        if (g == 0) {
          sm.wm[warp][2 * tig] = alpha[0];
          sm.wm[warp][2 * tig + 1] = alpha[1];
        }
        __syncwarp();
        for (int i = lane; i < GQ * D; i += 32) sm.ocorr[warp][i / D][i % D] *= sm.wm[warp][i / D];
        __syncwarp();
      }
    }
    float p[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) p[c] = st[c] == NEG_INF ? 0.f : ex2(st[c] - m_run[c & 1]);
    const u32 x0 = pack_bf16(p[0], p[1]), x1 = pack_bf16(p[2], p[3]);  // P^T as [token][head], m8n8 halves
    const u32 pb0 = transpose8x8(x0), pb1 = transpose8x8(x1);              // P^T's B fragment
#if P_SPLIT
    // the remainders P - bf16(P) as a second B fragment: O' takes P to about 2^-17 of itself
    const u32 y0 = pack_bf16(p[0] - bf(x0 & 0xFFFFu), p[1] - bf(x0 >> 16));
    const u32 y1 = pack_bf16(p[2] - bf(x1 & 0xFFFFu), p[3] - bf(x1 >> 16));
    const u32 pr0 = transpose8x8(y0), pr1 = transpose8x8(y1);
    l_part[0] += p[0] + p[2];
    l_part[1] += p[1] + p[3];
#else
    // l sums the bf16 P the MMA multiplies, so O / l is a weighted mean whose weights sum to 1: P's rounding errors
    // move the mean less than they would scale it.
    l_part[0] += bf(x0 & 0xFFFFu) + bf(x1 & 0xFFFFu);
    l_part[1] += bf(x0 >> 16) + bf(x1 >> 16);
#endif

    // ---- O'^T += V'^T·P^T ----
#pragma unroll
    for (int mb = 0; mb < D / 16; ++mb) {
      u32 H0 = hbytes(cb.v.h, 2 * mb), H1 = hbytes(cb.v.h, 2 * mb + 1);
      if (PATCHED) {
        const uint2 x = ld8<true>(tp + V_L + lane * 16 + (mb >> 1) * 512 + 8 * (mb & 1));
        H0 ^= x.x;
        H1 ^= x.y;
      }
      const u32 L0 = cb.v.l[2 * mb], L1 = cb.v.l[2 * mb + 1];
      const u32 a0 = prmt(L0, H0, 0x5140), a1 = prmt(L1, H1, 0x5140);
      const u32 a2 = prmt(L0, H0, 0x7362), a3 = prmt(L1, H1, 0x7362);
      mma(o[mb], a0, a1, a2, a3, pb0, pb1);
#if P_SPLIT
      mma(o[mb], a0, a1, a2, a3, pr0, pr1);
#endif
    }
    if (nv_tot) {  // V escapes: O[h][d] += P[h][t] (V[t][d] - V'_decoded[t][d] 2^(top - 127))
      // the P the MMAs multiplied (to ~2^-17 with P_SPLIT)
      sm.pst[warp][2 * tig][g] = P_SPLIT ? p[0] : bf(x0 & 0xFFFFu);
      sm.pst[warp][2 * tig + 1][g] = P_SPLIT ? p[1] : bf(x0 >> 16);
      sm.pst[warp][2 * tig][g + 8] = P_SPLIT ? p[2] : bf(x1 & 0xFFFFu);
      sm.pst[warp][2 * tig + 1][g + 8] = P_SPLIT ? p[3] : bf(x1 >> 16);
      __syncwarp();
      for (int base = 0; base < nv_tot; base += 32) {
        const int i = base + lane;
        const bool ok = i < nv_tot;
        int key = D + lane, t = 0;
        float delta = 0.f;
        if (base == 0) {
          key = ok ? v_d : key;
          t = v_t;
          delta = v_delta;
        } else if (ok) {
          const Escape x = locate<SH>(tp, entry_at<SH>(tp, i, nv_in, 1, ovf_ptr, arena_ref, gtile, h, num_kv_heads), 1);
          key = x.d;
          t = x.t;
          delta = bf(x.truth) - bf(x.wrong) * sm.vsc[x.d];
        }
        float add[GQ];
#pragma unroll
        for (int hh = 0; hh < GQ; ++hh) add[hh] = sm.pst[warp][hh][t] * delta;
        accumulate<D>(&sm.ocorr[warp][0][0], key, add, ok, lane);
      }
      ocorr_used = true;
    }
  };

#if RING_PATCH
  // A slot's escapes as operand patches (patch_of), up to 64 of each kind: true if the tile has entries and all of
  // them patch exactly; then each entry's L byte is rewritten in the slot and its H bits are kept for apply_patches.
  u32 pk[2], pv[2];
  auto prepare_patches = [&](const u8* sp, long gtile) -> bool {
    const uint2 tr = ld8<true>(sp + TR);
    const int nk_tot = tr.x & 0xFFFF, nv_tot = tr.x >> 16, nk_in = tr.y & 0xFFFF, nv_in = tr.y >> 16;
    if ((nk_tot | nv_tot) == 0 || nk_tot > 64 || nv_tot > 64) return false;  // warp-uniform
    bool ok = true;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      pk[r] = pv[r] = 0u;
      const int i = 32 * r + lane;
      if (i < nk_tot) ok &= patch_of<true>(sp, entry_at<true>(sp, i, nk_in, 0, ovf_ptr, arena_ref, gtile, h, num_kv_heads),
                                         0, sm.tops, pk[r]);
      if (i < nv_tot) ok &= patch_of<true>(sp, entry_at<true>(sp, i, nv_in, 1, ovf_ptr, arena_ref, gtile, h, num_kv_heads),
                                         1, sm.tops, pv[r]);
    }
    if (!__all_sync(FULL, ok)) return false;
    u8* w = const_cast<u8*>(sp);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (pk[r]) w[K_L + (pk[r] & (LP - 1))] = u8(pk[r] >> 18);
      if (pv[r]) w[V_L + (pv[r] & (LP - 1))] = u8(pv[r] >> 18);
    }
    __syncwarp();
    return true;
  };
  // After the slot's planes are in registers: the L planes become the H-bit XOR planes (each lane clears the
  // chunks it loaded, then each entry sets its byte).
  auto apply_patches = [&](const u8* sp) {
    u8* w = const_cast<u8*>(sp);
#pragma unroll
    for (int c = 0; c < NLC; ++c) {
      *reinterpret_cast<uint4*>(w + K_L + lane * 16 + c * 512) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(w + V_L + lane * 16 + c * 512) = make_uint4(0u, 0u, 0u, 0u);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (pk[r]) w[K_L + (pk[r] & (LP - 1))] = u8((pk[r] >> 11) & 0x7Fu);
      if (pv[r]) w[V_L + (pv[r] & (LP - 1))] = u8((pv[r] >> 11) & 0x7Fu);
    }
    __syncwarp();
  };
#endif

#if RING
  // RING - 1 tiles in flight while one decodes
  for (int kk = 0;; ++kk) {
    const int tile = t_begin + warp + kk * WARPS;
    if (tile >= t_end) break;
    issue(kk + RING - 1, tile + (RING - 1) * WARPS);
#if RING_BULK
    mbar_wait(smem_u32(&sm.bar[warp][kk % RING]), u32(kk / RING) & 1u);
#else
    cp_wait<RING - 1>();
#endif
    __syncwarp();
    const u8* sp = &sm.ring[warp][kk % RING][0];
    b0.blk = sm.slot_blk[warp][kk % RING];
#if RING_PATCH
    if (prepare_patches(sp, b0.blk * TPP + tile % TPP)) {
      load_buf<true>(b0, sp, lane);  // the L planes as patched
      apply_patches(sp);
      process(b0, tile, sp, true);
#if RING_BULK
      fence_proxy_async();  // this warp's writes to the slot are ordered before the bulk copy that refills it
#endif
    } else
#endif
    {
      load_buf<true>(b0, sp, lane);
      process(b0, tile, sp, false);
    }
    __syncwarp();  // every lane is done with the slot before the next issue refills it
  }
#if !RING_BULK
  cp_wait<0>();
#endif
#else
  // Two buffers in turn: the next tile's bytes are in flight while this one decodes.
  while (tile < t_end) {
    if (tile + WARPS < t_end) fetch(b1, kk + 1, tile + WARPS);
    process(b0, tile, tile_ptr(b0.blk, tile), false);
    tile += WARPS;
    ++kk;
    if (tile >= t_end) break;
    if (tile + WARPS < t_end) fetch(b0, kk + 1, tile + WARPS);
    process(b1, tile, tile_ptr(b1.blk, tile), false);
    tile += WARPS;
    ++kk;
  }
#endif

  // ---- this warp's heads: l over the 8 lanes of each; O^T unscaled, plus the V corrections ----
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l_part[j] += __shfl_xor_sync(FULL, l_part[j], 4);
    l_part[j] += __shfl_xor_sync(FULL, l_part[j], 8);
    l_part[j] += __shfl_xor_sync(FULL, l_part[j], 16);
    if (g == 0) {
      sm.wm[warp][2 * tig + j] = m_run[j];
      sm.wl[warp][2 * tig + j] = l_part[j];
    }
  }
  __syncwarp();
#pragma unroll
  for (int mb = 0; mb < D / 16; ++mb) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int d = 16 * mb + g + 8 * (c >> 1), hh = 2 * tig + (c & 1);
      if (hh < GQ) sm.ocorr[warp][hh][d] += o[mb][c] * sm.vsc[d];
    }
  }
  __syncthreads();

  // ---- combine the warps (fixed order) ----
  for (int i = threadIdx.x; i < GQ * D; i += WARPS * 32) {
    const int hh = i / D, d = i % D;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm.wm[w][hh]);
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float f = M == NEG_INF ? 0.f : ex2(sm.wm[w][hh] - M);
      L += f * sm.wl[w][hh];
      O += f * sm.ocorr[w][hh][d];
    }
    const float res = L > 0.f ? O / L : 0.f;
    const int hq = h * GQ + hh;
    if (num_splits == 1) {
      out[(long)seq * stride_o0 + (long)hq * stride_o1 + d] = u16(pack_bf16(res, 0.f) & 0xFFFFu);
    } else {
      const long row = ((long)seq * num_kv_heads * GQ + hq) * num_splits + split;
      part_o[row * D + d] = res;
      if (d == 0) {
        part_ml[row * 2] = M;
        part_ml[row * 2 + 1] = L;
      }
    }
  }
  if (num_splits == 1 || num_splits > MERGE_SPLITS || split_count == nullptr) return;  // kv_merge follows, or none

  // ---- the last split of this (sequence, KV head) to finish merges them all: no second launch ----
  __threadfence();  // this block's partial rows, published before its count
  __syncthreads();
  int* count = split_count + (long)seq * num_kv_heads + h;
  // atomicInc wraps the last split's count back to 0, ready for the next launch (a CUDA graph replays this one);
  // the counters are per device, so decode launches on one device run on one stream (vLLM's forward stream)
  if (threadIdx.x == 0)
    sm.last_split = atomicInc(reinterpret_cast<unsigned*>(count), num_splits - 1) == num_splits - 1;
  __syncthreads();
  if (!sm.last_split) return;
  __threadfence();  // the other splits' rows, published before their counts, are visible from here
  // each split's weight 2^(m - M) l a head (a warp a head, a lane a split; ocorr is spent), then each thread sums 4
  // channels of a head over the splits in split order: kv_merge's arithmetic, its bits, with 16-byte L2 loads
  float* weight = &sm.ocorr[0][0][0];  // [GQ][MERGE_SPLITS]
  const long row0 = ((long)seq * num_kv_heads + h) * GQ * num_splits;
  for (int hh = warp; hh < GQ; hh += WARPS) {
    const float* ml = part_ml + (row0 + (long)hh * num_splits) * 2;
    float m[2], l[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int s = lane + 32 * j;
      m[j] = s < num_splits ? __ldcg(ml + 2 * s) : NEG_INF;
      l[j] = s < num_splits ? __ldcg(ml + 2 * s + 1) : 0.f;
    }
    float M = fmaxf(m[0], m[1]);
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL, M, o));
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int s = lane + 32 * j;
      if (s < num_splits)
        weight[hh * MERGE_SPLITS + s] = (M == NEG_INF || l[j] == 0.f) ? 0.f : __fmul_rn(ex2(m[j] - M), l[j]);
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < GQ * D / 4; c += WARPS * 32) {
    const int hh = c / (D / 4), d0 = 4 * (c % (D / 4));
    const float* w = weight + hh * MERGE_SPLITS;
    const float* po = part_o + (row0 + (long)hh * num_splits) * D + d0;
    float L = 0.f;
    float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < num_splits; ++s) {
      const float4 p = __ldcg(reinterpret_cast<const float4*>(po + (long)s * D));
      const float f = w[s];
      L = __fadd_rn(L, f);  // explicit rounding: kv_merge's bits whatever ptxas contracts
      O.x = __fmaf_rn(f, p.x, O.x), O.y = __fmaf_rn(f, p.y, O.y);
      O.z = __fmaf_rn(f, p.z, O.z), O.w = __fmaf_rn(f, p.w, O.w);
    }
    u16* o = out + (long)seq * stride_o0 + (long)(h * GQ + hh) * stride_o1 + d0;
    const float r[4] = {O.x, O.y, O.z, O.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = u16(pack_bf16(L > 0.f ? r[i] / L : 0.f, 0.f) & 0xFFFFu);
  }
}

// The splits of one (sequence, query head) merged in split order by a second launch, one channel a thread, where the
// decode launch has no counters (a graph captured past their capacity, more than MERGE_SPLITS splits): the same
// arithmetic as the decode kernel's last split. Grid (sequences, query heads), D threads.
extern "C" __global__ void kv_merge(u16* __restrict__ out, const float* __restrict__ part_o,
                                    const float* __restrict__ part_ml, int stride_o0, int stride_o1, int num_q_heads,
                                    int num_splits) {
  const int seq = blockIdx.x, hq = blockIdx.y, d = threadIdx.x;
  const long base = ((long)seq * num_q_heads + hq) * num_splits;
  float M = NEG_INF;
  for (int s = 0; s < num_splits; ++s) M = fmaxf(M, part_ml[(base + s) * 2]);
  float L = 0.f, O = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float m = part_ml[(base + s) * 2], l = part_ml[(base + s) * 2 + 1];
    const float f = (M == NEG_INF || l == 0.f) ? 0.f : __fmul_rn(ex2(m - M), l);
    L = __fadd_rn(L, f);
    O = __fmaf_rn(f, part_o[(base + s) * D + d], O);
  }
  out[(long)seq * stride_o0 + (long)hq * stride_o1 + d] = u16(pack_bf16(L > 0.f ? O / L : 0.f, 0.f) & 0xFFFFu);
}

// ================================================================================================================
// Tile reader: tiles [N] of the pages to bf16 K and V [N, H, 16, D], escapes patched (checks, prefill).
// Grid (N, KV heads), one warp.
// ================================================================================================================
extern "C" __global__ void __launch_bounds__(32) kv_read_tiles(
    u16* __restrict__ out_k, u16* __restrict__ out_v, const u8* __restrict__ cache, const u8* __restrict__ tops,
    const int* __restrict__ ovf_ptr, const long long* __restrict__ arena_ref, const long long* __restrict__ gtiles,
    int num_kv_heads, long long block_stride, long long head_stride) {
  const int n = blockIdx.x, h = blockIdx.y, lane = threadIdx.x, g = lane >> 2, tig = lane & 3;
  const long gtile = gtiles[n];
  const u8* tp = cache + (gtile / TPP) * block_stride + h * head_stride + (gtile % TPP) * TILE_BYTES;
  const uint2 tr = ld8(tp + TR);
  for (int kind = 0; kind < 2; ++kind) {
    Planes pl;
    load_planes(pl, tp + lane * 16, tp + lane * 8, tp + lane * 4, kind ? V_L : K_L, kind ? V_H : K_H);
    u16* dst = (kind ? out_v : out_k) + ((long)n * num_kv_heads + h) * 16 * D;
    const u8* top = tops + (kind * num_kv_heads + h) * D;
#pragma unroll
    for (int q = 0; q < NG; ++q) {
      const u32 H4 = hbytes(pl.h, q), L4 = pl.l[q];
      const u32 pr[2] = {prmt(L4, H4, 0x5140), prmt(L4, H4, 0x7362)};
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        int t, d;
        if (kind == 0) {
          t = 8 * (q & 1) + g;
          d = 16 * (q >> 1) + 2 * tig + (b & 1) + 8 * (b >> 1);
        } else {
          d = 16 * (q >> 1) + g + 8 * (q & 1);
          t = 2 * tig + (b & 1) + 8 * (b >> 1);
        }
        const u32 scaled = (pr[b >> 1] >> (16 * (b & 1))) & 0xFFFFu;  // exponent 120 + c
        dst[t * D + d] = u16(scaled + ((int(top[d]) - 127) << 7));  // exponent top - 7 + c: no carry out
      }
    }
    __syncwarp();
    const int n_tot = min(16 * D, int(kind ? tr.x >> 16 : tr.x & 0xFFFF)), n_in = kind ? tr.y >> 16 : tr.y & 0xFFFF;
    for (int i = lane; i < n_tot; i += 32) {
      const Escape x = locate(tp, entry_at(tp, i, n_in, kind, ovf_ptr, arena_ref, gtile, h, num_kv_heads), kind);
      dst[x.t * D + x.d] = u16(x.truth);
    }
  }
}

