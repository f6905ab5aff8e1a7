// Glyd KV page code v3 on NVIDIA GPUs (sm_80+): decode attention, the page writer and a tile reader.
// Compiled at run time by NVRTC (kernels/nvrtc.py) with -D HEAD (64 or 128), CODE_BITS (3 or 4), GQ (query heads a
// KV head, <= 8), RESERVE (escape-list entries a tile), TPP (tiles a page) and WARPS (warps a block).
// The format is docs/format.md section 2 and glyd_engine/format/kv_page.py (the torch reference).
//
// Fragments (mma.sync.m16n8k16, bf16 in, fp32 accumulate); lane = 4 g + tig:
//   S^T = K'·Q'^T   A = K' [16 tokens x 16 channels],   B = Q'^T [16 channels x 8 query heads (>= GQ zero)]
//   O^T = V'^T·P^T  A = V'^T [16 channels x 16 tokens], B = P^T [16 tokens x 8 heads]
// Each half of the S^T accumulator is the m8n8 fragment of P^T's transpose: one movmatrix each turns it into P^T's
// B fragment, so probabilities never leave registers. K' and V' are the values scaled by 2^(127 - top) per channel (the
// pages store them so: exponent 120 + c); Q' = Q 2^(top_k - 127) makes S exact, O^T is scaled back at the end.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#ifndef CODE_BITS
#define CODE_BITS 3
#endif
#define D HEAD
#define CB CODE_BITS
#define LP (16 * D)             // L plane bytes (one of K, V)
#define HP (2 * CB * D)         // hi plane bytes
#define NW (CB * D / 64)        // hi words a lane
#define NLC (D / 32)            // 16-byte L chunks a lane
#define NG (D / 8)              // groups of 4 values a lane
// a lane's hi words are stored in lane-major chunks of 4, 2 and 1 words (kv_page._word_offsets)
#define W4 (NW / 4)             // 16-byte chunks
#define W2 ((NW % 4) / 2)       // 8-byte chunks (0 or 1)
#define W1 (NW % 2)             // 4-byte chunks (0 or 1)
#define HCONST (CB == 3 ? 0x3C3C3C3Cu : 0x38383838u)  // the constant bits of H = sign << 7 | (128 - 2^CB + c) >> 1
#define KEEP (CB == 3 ? 0x83FFu : 0x87FFu)            // sign, c's bits of the exponent, mantissa
#define K_L 0
#define V_L LP
#define K_H (2 * LP)
#define V_H (2 * LP + HP)
#define TR (2 * (LP + HP))
#define LIST (TR + 8)
#define TILE_BYTES (LIST + 2 * RESERVE)
#define PAGE_BYTES (TPP * TILE_BYTES)
#define FULL 0xffffffffu
#ifndef SKIP_ESCAPES
#define SKIP_ESCAPES 0  // benchmarks only (wrong results): 1 skips K's corrections, 2 V's, 3 both
#endif
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
#ifndef WMIN_BLOCKS
#define WMIN_BLOCKS 8  // page-writer blocks a multiprocessor: sets its register budget
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

static_assert(D == 64 || D == 128, "head size 64 or 128");
static_assert(CB == 3 || CB == 4, "3- or 4-bit codes");
static_assert(GQ >= 1 && GQ <= 8, "1..8 query heads a KV head");
static_assert(TILE_BYTES % 16 == 0, "tiles are whole 16-byte units");

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}
__device__ __forceinline__ u32 rotr(u32 x, int n) { return __funnelshift_r(x, x, n); }
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float bf(u32 bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float pow2(int e) { return __uint_as_float(u32(e + 127) << 23); }  // 2^e, |e| < 127
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}
// Loads of tile bytes: read-only global memory (SH false) or a copy in shared memory (SH true).
template <bool SH = false>
__device__ __forceinline__ uint4 ld16(const u8* p) {
  return SH ? *reinterpret_cast<const uint4*>(p) : __ldg(reinterpret_cast<const uint4*>(p));
}
template <bool SH = false>
__device__ __forceinline__ uint2 ld8(const u8* p) {
  return SH ? *reinterpret_cast<const uint2*>(p) : __ldg(reinterpret_cast<const uint2*>(p));
}
template <bool SH = false>
__device__ __forceinline__ u32 ld4(const u8* p) {
  return SH ? *reinterpret_cast<const u32*>(p) : __ldg(reinterpret_cast<const u32*>(p));
}
template <bool SH = false>
__device__ __forceinline__ u32 ld2(const u8* p) {
  return SH ? u32(*reinterpret_cast<const u16*>(p)) : u32(__ldg(reinterpret_cast<const u16*>(p)));
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
// A whole tile by the bulk-copy engine (sm_90+): one lane issues it, an mbarrier a ring slot counts its bytes in.
__device__ __forceinline__ void mbar_init(u64* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  asm volatile("{ .reg .pred p; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra WAIT_%=; }"
               ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// ---- one tile's K or V planes of one lane ------------------------------------------------------------------------
struct Planes {
  u32 l[4 * NLC];  // L bytes: word q is group q (4 values, byte b = value b)
  u32 h[NW];       // hi bits
};

// t16 = tile + lane * 16, t8 = tile + lane * 8, t4 = tile + lane * 4: the offsets below fold into the loads.
template <bool SH = false>
__device__ __forceinline__ void load_planes(Planes& p, const u8* t16, const u8* t8, const u8* t4, int l_off,
                                            int h_off) {
#pragma unroll
  for (int c = 0; c < NLC; ++c) {
    uint4 v = ld16<SH>(t16 + l_off + c * 512);
    p.l[4 * c] = v.x; p.l[4 * c + 1] = v.y; p.l[4 * c + 2] = v.z; p.l[4 * c + 3] = v.w;
  }
#pragma unroll
  for (int c = 0; c < W4; ++c) {
    uint4 a = ld16<SH>(t16 + h_off + c * 512);
    p.h[4 * c] = a.x; p.h[4 * c + 1] = a.y; p.h[4 * c + 2] = a.z; p.h[4 * c + 3] = a.w;
  }
  if (W2) {
    uint2 b = ld8<SH>(t8 + h_off + 512 * W4);
    p.h[4 * W4] = b.x; p.h[4 * W4 + 1] = b.y;
  }
  if (W1) p.h[NW - 1] = ld4<SH>(t4 + h_off + 512 * W4 + 256 * W2);
}

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

#if CB == 3
// The four H bytes (sign << 7 | (120 + c) >> 1) of group q: groups 0-2 of each 8 unrotated, 3-5 rotated by 3,
// 6 and 7 from the two bits a byte the others leave (docs/format.md). q is a compile-time constant after unrolling.
__device__ __forceinline__ u32 hbytes(const u32 (&w)[NW], int q) {
  const int u = q >> 3, r = q & 7, b = 3 * u;
  if (r < 3) return (w[b + r] & 0x83838383u) | HCONST;
  if (r < 6) return (rotr(w[b + r - 3], 3) & 0x83838383u) | HCONST;
  return ((rotr(w[b + r - 6], 6) & 0x81818181u) | (rotr(w[b + 2], r - 2) & 0x02020202u)) | HCONST;
}
// Group q's hi bits: (word, rotation) of the piece holding the sign and c's bit 1, and of the one holding bit 2.
// Branch-free (escape entries run it with a different q in each lane): r % 3 and 3 (r / 3) come from packed tables.
__device__ __forceinline__ void group_words(int q, int& wa, int& ra, int& wb, int& rb) {
  const int u = q >> 3, r = q & 7;
  wa = 3 * u + int((0x4924u >> (2 * r)) & 3u);
  ra = int((0x66333000u >> (4 * r)) & 15u);
  wb = r < 6 ? wa : 3 * u + 2;
  rb = r < 6 ? ra : r - 2;
}
#else
// The four H bytes (sign << 7 | (112 + c) >> 1) of group q: two groups a word, unrotated and rotated by 4.
__device__ __forceinline__ u32 hbytes(const u32 (&w)[NW], int q) {
  return (rotr(w[q >> 1], 4 * (q & 1)) & 0x87878787u) | HCONST;
}
__device__ __forceinline__ void group_words(int q, int& wa, int& ra, int& wb, int& rb) {
  wa = wb = q >> 1;
  ra = rb = 4 * (q & 1);
}
#endif

// ---- escapes -----------------------------------------------------------------------------------------------------
// Byte offset of lane ln's hi word w in the hi plane.
__device__ __forceinline__ int hword_offset(int ln, int w) {
  const int in4 = (w >> 2) * 512 + ln * 16 + 4 * (w & 3);
  const int in2 = 512 * W4 + ln * 8 + 4 * (w - 4 * W4);
  const int in1 = 512 * W4 + 256 * W2 + ln * 4;
  return w < 4 * W4 ? in4 : ((W2 && w < 4 * W4 + 2) ? in2 : in1);  // selects, not branches
}

struct Escape {
  int t, d;
  u32 wrong, truth;  // bf16 bits: the value as the fast path decoded it (scaled domain), and the value itself
};

// Entry `e` (o | exponent >> 3 << 11) of K (kind 0) or V (kind 1) of `tile`.
template <bool SH = false>
__device__ __forceinline__ Escape locate(const u8* tile, u32 e, int kind) {
  const int o = e & (LP - 1);  // in the tile even for the garbage list of a tile nobody wrote
  const int ln = (o >> 4) & 31, q = ((o >> 9) << 2) | ((o >> 2) & 3), b = o & 3;
  const u32 L = tile[(kind ? V_L : K_L) + o];
  int wa, ra, wb, rb;
  group_words(q, wa, ra, wb, rb);
  const u8* hp = tile + (kind ? V_H : K_H);
  const u32 A = rotr(ld4<SH>(hp + hword_offset(ln, wa)), ra);
#if CB == 3
  const u32 B = rotr(ld4<SH>(hp + hword_offset(ln, wb)), rb);
  const u32 hb = (((A >> (8 * b)) & 0x81u) | ((B >> (8 * b)) & 0x02u)) | 0x3Cu;
#else
  const u32 hb = ((A >> (8 * b)) & 0x87u) | 0x38u;
#endif
  Escape x;
  x.wrong = (hb << 8) | L;
  x.truth = (x.wrong & KEEP) | ((e >> 11) << (7 + CB));
  const int g = ln >> 2, tig = ln & 3;
  if (kind == 0) {
    x.t = 8 * (q & 1) + g;
    x.d = 16 * (q >> 1) + 2 * tig + (b & 1) + 8 * (b >> 1);
  } else {
    x.d = 16 * (q >> 1) + g + 8 * (q & 1);
    x.t = 2 * tig + (b & 1) + 8 * (b >> 1);
  }
  return x;
}

// Entry i of a kind: the page's list (K from its start, V from its end), then the tile's overflow run.
// `arena_ref` holds the arena's address and size (in 8-entry units) in device memory, so that a CUDA graph captured
// before the host compacts the arena into a new one reads the new one.
template <bool SH = false>
__device__ __forceinline__ u32 entry_at(const u8* tile, int i, int n_in, int kind, const int* ovf_ptr,
                                        const long long* arena_ref, long gtile, int h, int num_kv_heads) {
  if (i < n_in) return ld2<SH>(tile + LIST + 2 * (kind ? RESERVE - 1 - i : i));
  const int p = __ldg(ovf_ptr + (gtile * num_kv_heads + h) * 2 + kind);
  if (p < 0 || i - n_in >= (8 << (p & 15))) return 0u;  // only an unwritten tile's garbage counts get here
  const u16* arena = reinterpret_cast<const u16*>(__ldg(arena_ref));
  return __ldg(arena + (long)(p >> 4) * 8 + (i - n_in));
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
// combines its warps, and with several splits `kv_merge` combines the splits in a fixed order.
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
};

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) kv_decode_attention(
    const u16* __restrict__ query, u16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    const u8* __restrict__ cache, const u8* __restrict__ tops, const int* __restrict__ ovf_ptr,
    const long long* __restrict__ arena_ref, const int* __restrict__ block_table, const int* __restrict__ seq_lens,
    float scale_log2, int stride_q0, int stride_q1, int stride_o0, int stride_o1, int bt_stride, int num_kv_heads,
    int num_splits, long long block_stride, long long head_stride) {
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
  if (lane < RING) mbar_init(&sm.bar[warp][lane]);
  mbar_init_fence();
  __syncwarp();
#endif
  auto issue = [&](int kk, int tl) {
    if (tl < t_end) {
      const long blk = block_of(kk);
      const u8* src = tile_ptr(blk, tl);
      u8* dst = &sm.ring[warp][kk % RING][0];
      if (lane == 0) sm.slot_blk[warp][kk % RING] = blk;
#if RING_BULK
      if (lane == 0) bulk_copy(dst, src, TILE_BYTES, &sm.bar[warp][kk % RING]);
#else
      constexpr int CHUNKS = TILE_BYTES / 16;
      src += 16 * lane;
      dst += 16 * lane;
#pragma unroll
      for (int c = 0; c < CHUNKS / 32; ++c) cp_async16(dst + 512 * c, src + 512 * c);
      if (CHUNKS % 32 && lane < CHUNKS % 32) cp_async16(dst + 512 * (CHUNKS / 32), src + 512 * (CHUNKS / 32));
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
    if (SKIP_ESCAPES != 1 && SKIP_ESCAPES != 3 && lane < nk_tot) {
      const u32 e = lane < nk_in ? cb.ek : entry_at<SH>(tp, lane, nk_in, 0, ovf_ptr, arena_ref, gtile, h, num_kv_heads);
      const Escape x = locate<SH>(tp, e, 0);
      k_vals = x.truth | ((x.wrong ^ 0x8000u) << 16);  // the decoded value enters negated
      k_where = u32(x.t) | (u32(x.d) << 8);
    }
    int v_d = 0, v_t = 0;
    float v_delta = 0.f;
    if (SKIP_ESCAPES < 2 && lane < nv_tot) {  // this lane's V entry, located now: its loads overlap the K work
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
    if (SKIP_ESCAPES != 1 && SKIP_ESCAPES != 3 && nk_tot) {
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
    if (SKIP_ESCAPES < 2 && nv_tot) {  // V escapes: O[h][d] += P[h][t] (V[t][d] - V'_decoded[t][d] 2^(top - 127))
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
    if (SKIP_ESCAPES || (nk_tot | nv_tot) == 0 || nk_tot > 64 || nv_tot > 64) return false;  // warp-uniform
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
    mbar_wait(&sm.bar[warp][kk % RING], u32(kk / RING) & 1u);
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
}

// Splits of one (sequence, query head) combined in a fixed order. Grid (sequences, query heads), D threads.
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
    const float f = (M == NEG_INF || l == 0.f) ? 0.f : ex2(m - M) * l;
    L += f;
    O += f * part_o[(base + s) * D + d];
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

// Sizes of the dynamic shared memory the kernels above take (read once by the launcher).
extern "C" __global__ void kv_sizes(int* out) {
  out[0] = int(sizeof(Smem));
  out[1] = int(sizeof(WSmem));
}
