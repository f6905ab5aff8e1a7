// The page writer (kv_write): encodes the step's K/V into page code v3 tiles, their escape lists and overflow runs.
// Included by kv_pages.cu after kv_code.cuh; docs/gpu.md, "Page writer".
#pragma once
#include "kv_code.cuh"

#ifndef WMIN_BLOCKS
#define WMIN_BLOCKS 8  // page-writer blocks a multiprocessor: sets its register budget
#endif

// ================================================================================================================
// Page writer: appends the step's K/V [T, H, D] at `slots` (block * 16 * TPP + offset; -1 padding). A tile's tokens
// must be consecutive in the call and in position order (vLLM's slot mapping is); K/V rows 16-byte aligned. Grid
// (ceil(T / span), KV heads), 128 threads: block b writes the tile runs whose first token is one of its `span` tokens
// span b..span b + span - 1 (span 1 for decode steps, a block a sequence; 16 for long runs, fewer idle blocks).
// Entries past the list go to the tile's overflow run. A missing or short run is replaced here by one of the next
// power of two entries, taken from the arena with one atomic add on its top (`alloc[0]`, in 8-entry units; the old
// run's entries are copied over, its space left to the host's next compaction). When the arena has no room, the
// block writes the tile's bytes but not its counts, counts the miss in `alloc[1]` and records the entries it needs in
// `need[token, head, kind]`, so the caller can grow the arena and run the writer again with `only_needy` set.
// ================================================================================================================
#define WTHREADS 128
struct WSmem {
  u8 l[2][LP];                       // the tile's L planes (old bytes, then the run's)
  u32 hw[2][HP / 4];                 // the hi planes as words
  u8 esc[2][16][D];                  // escape flags of the run's values
  u16 ent[2][16][D];                 // their entries
  int cnt[2][16];                    // escapes a (kind, token)
  int item_base[32], kind_base[32];  // prefix over (token, kind) items: all entries, entries of that kind
  int in_page[2];
  int run_ptr[2], copy_from[2], copy_n[2];  // each kind's overflow run after this write, and entries to move
  u32 leaders;                       // the block's tokens that start a tile run
};

__device__ __forceinline__ void lane_q_b(int kind, int t, int d, int& ln, int& q, int& b) {
  if (kind == 0) {
    const int nb = t >> 3, g = t & 7, ks = d >> 4, r = d & 15;
    const int half = r >> 3, tig = (r & 7) >> 1;
    ln = 4 * g + tig; q = 2 * ks + nb; b = (r & 1) + 2 * half;
  } else {
    const int mb = d >> 4, r = d & 15, half = r >> 3, g = r & 7;
    const int tig = (t & 7) >> 1;
    ln = 4 * g + tig; q = 2 * mb + half; b = (t & 1) + 2 * (t >> 3);
  }
}

// Value (kind, t, d)'s hi bits: their masks in word wa and word wb (zero for the 4-bit code), and its bits there.
__device__ __forceinline__ void hi_bits(int kind, int t, int d, int s, int c, int& ln, int& q, int& b, int& wa,
                                        int& wb, u32& amask, u32& bmask, u32& abits, u32& bbits) {
  lane_q_b(kind, t, d, ln, q, b);
  int ra, rb;
  group_words(q, wa, ra, wb, rb);
#if CB == 3
  const int pa = (8 * b + 7 + ra) & 31, p1 = (8 * b + ra) & 31, p2 = (8 * b + 1 + rb) & 31;
  amask = (1u << pa) | (1u << p1);
  bmask = 1u << p2;
  abits = (u32(s) << pa) | (u32((c >> 1) & 1) << p1);
  bbits = u32((c >> 2) & 1) << p2;
#else
  amask = rotr(0x87u << (8 * b), 32 - ra);  // bits 8b + {7, 2, 1, 0} before the rotation by ra
  bmask = 0u;
  abits = rotr((u32(s) << 7 | u32(c >> 1)) << (8 * b), 32 - ra);
  bbits = 0u;
#endif
}

__device__ void write_run(WSmem& sm, u8* __restrict__ cache, const u16* __restrict__ key,
                          const u16* __restrict__ value, const long long* __restrict__ slots,
                          const u8* __restrict__ tops, int* __restrict__ ovf_ptr, u16* __restrict__ arena,
                          int* __restrict__ alloc, int arena_units, int* __restrict__ need, int i0, int h,
                          int num_tokens, int num_kv_heads, int k_stride0, int k_stride1, int v_stride0, int v_stride1,
                          int only_needy, long long block_stride, long long head_stride) {
  const int tid = threadIdx.x;
  const long s0 = slots[i0];
  const long gtile = s0 / 16;
  const bool needy = need[((long)i0 * num_kv_heads + h) * 2] != 0 || need[((long)i0 * num_kv_heads + h) * 2 + 1] != 0;
  if (only_needy && !needy) return;  // uniform over the block
  const int t0 = int(s0 % 16);
  int n = 1;
  while (n < 16 - t0 && i0 + n < num_tokens && slots[i0 + n] == s0 + n) ++n;
  u8* tp = cache + (gtile / TPP) * block_stride + h * head_stride + (gtile % TPP) * TILE_BYTES;
  const bool whole = t0 == 0 && n == 16;

  // the run's K/V rows, 8 channels (16 bytes) a thread and item; each item's load is issued one item ahead (the
  // first before the set-up), keeping the registers few enough for many blocks a multiprocessor
  const int items = 2 * n * (D / 8);
  auto load_item = [&](int i) -> uint4 {
    const int kind = i / (n * (D / 8)), t = t0 + (i / (D / 8)) % n, d0 = 8 * (i % (D / 8));
    const u16* src = kind ? value + (long)(i0 + t - t0) * v_stride0 + (long)h * v_stride1
                          : key + (long)(i0 + t - t0) * k_stride0 + (long)h * k_stride1;
    return *reinterpret_cast<const uint4*>(src + d0);
  };
  uint4 next = tid < items ? load_item(tid) : make_uint4(0, 0, 0, 0);

  // the planes: a run that does not cover the whole tile keeps the other tokens' bytes and bits
  if (!whole) {
    for (int i = tid; i < 2 * LP / 16; i += WTHREADS)
      reinterpret_cast<uint4*>(&sm.l[0][0])[i] = reinterpret_cast<const uint4*>(tp)[i];
    for (int i = tid; i < 2 * HP / 16; i += WTHREADS)
      reinterpret_cast<uint4*>(&sm.hw[0][0])[i] = reinterpret_cast<const uint4*>(tp + K_H)[i];
  } else {
    for (int i = tid; i < 2 * HP / 16; i += WTHREADS) reinterpret_cast<uint4*>(&sm.hw[0][0])[i] = make_uint4(0, 0, 0, 0);
  }
  for (int i = tid; i < 32; i += WTHREADS) sm.cnt[i >> 4][i & 15] = 0;
  __syncthreads();
  if (!whole) {  // clear the run's hi bits
    for (int i = tid; i < 2 * n * D; i += WTHREADS) {
      const int kind = i / (n * D), t = t0 + (i / D) % n, d = i % D;
      int ln, q, b, wa, wb;
      u32 amask, bmask, abits, bbits;
      hi_bits(kind, t, d, 0, 0, ln, q, b, wa, wb, amask, bmask, abits, bbits);
      atomicAnd(&sm.hw[kind][hword_offset(ln, wa) / 4], ~amask);
      if (bmask) atomicAnd(&sm.hw[kind][hword_offset(ln, wb) / 4], ~bmask);
    }
    __syncthreads();
  }
  // encode the run's values, 8 channels a thread and item
#pragma unroll 1
  for (int i = tid; i < items; i += WTHREADS) {
    const uint4 raw = next;
    if (i + WTHREADS < items) next = load_item(i + WTHREADS);
    const int kind = i / (n * (D / 8)), t = t0 + (i / (D / 8)) % n, d0 = 8 * (i % (D / 8));
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    const uint2 tw = *reinterpret_cast<const uint2*>(tops + (kind * num_kv_heads + h) * D + d0);
    const u32 topw[2] = {tw.x, tw.y};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int d = d0 + j;
      const u32 bits = (words[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
      const int e = (bits >> 7) & 0xFF, s = bits >> 15, m = bits & 0x7F;
      const int low = int((topw[j >> 2] >> (8 * (j & 3))) & 0xFFu) - ((1 << CB) - 1);
      int c = e - low;
      const bool esc = c < 0 || c >= (1 << CB);
      if (esc) c = e & ((1 << CB) - 1);
      int ln, q, b, wa, wb;
      u32 amask, bmask, abits, bbits;
      hi_bits(kind, t, d, s, c, ln, q, b, wa, wb, amask, bmask, abits, bbits);
      const int o = (q >> 2) * 512 + ln * 16 + (q & 3) * 4 + b;
      sm.l[kind][o] = u8(((c & 1) << 7) | m);
      if (abits) atomicOr(&sm.hw[kind][hword_offset(ln, wa) / 4], abits);
      if (bbits) atomicOr(&sm.hw[kind][hword_offset(ln, wb) / 4], bbits);
      sm.esc[kind][t][d] = esc;
      if (esc) {
        sm.ent[kind][t][d] = u16(o | ((e >> CB) << 11));
        atomicAdd(&sm.cnt[kind][t], 1);
      }
    }
  }
  __syncthreads();
  // entries: in token order, K's before V's, channel order within; the list takes them while it has room
  const uint2 tr = t0 == 0 ? make_uint2(0, 0) : *reinterpret_cast<const uint2*>(tp + TR);
  const int ntot[2] = {int(tr.x & 0xFFFF), int(tr.x >> 16)}, nin[2] = {int(tr.y & 0xFFFF), int(tr.y >> 16)};
  const int free_slots = (ntot[0] != nin[0] || ntot[1] != nin[1]) ? 0 : RESERVE - nin[0] - nin[1];
  if (tid < 32) {  // item it = 2 (t - t0) + kind, in the order entries are given slots
    const int it = tid, t = t0 + (it >> 1), kind = it & 1;
    const int c = (t < t0 + n) ? sm.cnt[kind][t] : 0;
    int all = c, own = c;  // inclusive prefixes over all items, and over the items of the same kind
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int a = __shfl_up_sync(FULL, all, off);
      if (it >= off) all += a;
    }
#pragma unroll
    for (int off = 2; off < 32; off <<= 1) {
      const int a = __shfl_up_sync(FULL, own, off);
      if (it >= off) own += a;
    }
    sm.item_base[it] = all - c;
    sm.kind_base[it] = own - c;
    const int inp = max(0, min(c, free_slots - (all - c)));  // this item's entries that fit in the list
    int ik = kind == 0 ? inp : 0, iv = kind == 1 ? inp : 0;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      ik += __shfl_xor_sync(FULL, ik, off);
      iv += __shfl_xor_sync(FULL, iv, off);
    }
    if (it == 0) {
      sm.in_page[0] = ik;
      sm.in_page[1] = iv;
    }
  }
  __syncthreads();
  if (tid == 0) {  // each kind's run must hold its old overflow entries and the ones this write adds
    for (int kind = 0; kind < 2; ++kind) {
      int add = 0;
      for (int t = t0; t < t0 + n; ++t) add += sm.cnt[kind][t];
      const int held = ntot[kind] - nin[kind], past = held + add - sm.in_page[kind];
      int* pp = ovf_ptr + (gtile * num_kv_heads + h) * 2 + kind;
      int p = *pp;
      sm.copy_n[kind] = 0;
      if (past > (p >= 0 ? 8 << (p & 15) : 0)) {
        int lg = 0;
        while ((8 << lg) < past) ++lg;
        const int off = atomicAdd(&alloc[0], 1 << lg);
        if (off <= arena_units - (1 << lg)) {
          if (p >= 0 && held > 0) sm.copy_from[kind] = p >> 4, sm.copy_n[kind] = held;
          p = (off << 4) | lg;
          *pp = p;
        } else {
          atomicAdd(&alloc[1], 1);  // no room: the entries past the old run are recorded in `need` below
        }
      }
      sm.run_ptr[kind] = p;
    }
  }
  __syncthreads();
#pragma unroll
  for (int kind = 0; kind < 2; ++kind) {  // a moved run's entries (the new ones go past them)
    const long from = (long)sm.copy_from[kind] * 8, to = (long)(sm.run_ptr[kind] >> 4) * 8;
    for (int i = tid; i < sm.copy_n[kind]; i += WTHREADS) arena[to + i] = arena[from + i];
  }
  bool short_run = false;
  {
    const int warp = tid >> 5, lane = tid & 31;
    for (int it = warp; it < 2 * n; it += WTHREADS / 32) {
      const int t = t0 + (it >> 1), kind = it & 1;
      if (sm.cnt[kind][t] == 0) continue;  // uniform over the warp
      int seen = 0;
      for (int c0 = 0; c0 < D; c0 += 32) {
        const int d = c0 + lane;
        const bool f = sm.esc[kind][t][d];
        const u32 bal = __ballot_sync(FULL, f);
        if (f) {
          const int r_in = seen + __popc(bal & ((1u << lane) - 1u));
          const int rank_all = sm.item_base[it] + r_in, rank_kind = sm.kind_base[it] + r_in;
          const u16 e = sm.ent[kind][t][d];
          if (rank_all < free_slots) {
            const int slot = kind ? RESERVE - 1 - (nin[kind] + rank_kind) : nin[kind] + rank_kind;
            *reinterpret_cast<u16*>(tp + LIST + 2 * slot) = e;
          } else {
            const int oidx = ntot[kind] + rank_kind - (nin[kind] + sm.in_page[kind]);
            const int p = sm.run_ptr[kind];
            const int cap = p >= 0 ? 8 << (p & 15) : 0;
            if (oidx < cap) arena[(long)(p >> 4) * 8 + oidx] = e;
            else { short_run = true; atomicMax(&need[((long)i0 * num_kv_heads + h) * 2 + kind], oidx + 1); }
          }
        }
        seen += __popc(bal);
      }
    }
  }
  const int failed = __syncthreads_or(short_run);
  // planes back to global memory, then the counts (not when an overflow run was short: the caller retries)
  for (int i = tid; i < 2 * LP / 16; i += WTHREADS)
    reinterpret_cast<uint4*>(tp)[i] = reinterpret_cast<const uint4*>(&sm.l[0][0])[i];
  for (int i = tid; i < 2 * HP / 16; i += WTHREADS)
    reinterpret_cast<uint4*>(tp + K_H)[i] = reinterpret_cast<const uint4*>(&sm.hw[0][0])[i];
  if (tid == 0 && !failed) {
    int add[2] = {0, 0};
    for (int t = t0; t < t0 + n; ++t) { add[0] += sm.cnt[0][t]; add[1] += sm.cnt[1][t]; }
    uint2 nt;
    nt.x = u32(ntot[0] + add[0]) | (u32(ntot[1] + add[1]) << 16);
    nt.y = u32(nin[0] + sm.in_page[0]) | (u32(nin[1] + sm.in_page[1]) << 16);
    *reinterpret_cast<uint2*>(tp + TR) = nt;
    if (only_needy) need[((long)i0 * num_kv_heads + h) * 2] = need[((long)i0 * num_kv_heads + h) * 2 + 1] = 0;
  }
  __syncthreads();  // the shared planes are the next run's
}

extern "C" __global__ void __launch_bounds__(WTHREADS, WMIN_BLOCKS) kv_write(
    u8* __restrict__ cache, const u16* __restrict__ key, const u16* __restrict__ value,
    const long long* __restrict__ slots, const u8* __restrict__ tops, int* __restrict__ ovf_ptr,
    const long long* __restrict__ arena_ref, int* __restrict__ alloc, int* __restrict__ need, int num_tokens,
    int num_kv_heads, int k_stride0, int k_stride1, int v_stride0, int v_stride1, int only_needy, int span,
    long long block_stride, long long head_stride) {
  extern __shared__ __align__(16) u8 wsmem_raw[];
  WSmem& sm = *reinterpret_cast<WSmem*>(wsmem_raw);
  u16* const arena = reinterpret_cast<u16*>(arena_ref[0]);  // read here, not baked into a captured launch
  const int arena_units = int(arena_ref[1]);
  const int h = blockIdx.y, first = span * blockIdx.x;
  if (threadIdx.x < 32) {  // which of the block's `span` (1..16) tokens start a tile run
    const int i = first + threadIdx.x;
    bool lead = false;
    if (threadIdx.x < span && i < num_tokens) {
      const long si = slots[i];
      lead = si >= 0 && (i == 0 || slots[i - 1] < 0 || slots[i - 1] / 16 != si / 16);
    }
    const u32 mask = __ballot_sync(FULL, lead);
    if (threadIdx.x == 0) sm.leaders = mask;
  }
  __syncthreads();
  u32 leaders = sm.leaders;
  while (leaders) {
    const int j = __ffs(leaders) - 1;
    leaders &= leaders - 1;
    write_run(sm, cache, key, value, slots, tops, ovf_ptr, arena, alloc, arena_units, need, first + j, h, num_tokens,
              num_kv_heads, k_stride0, k_stride1, v_stride0, v_stride1, only_needy, block_stride, head_stride);
  }
}

