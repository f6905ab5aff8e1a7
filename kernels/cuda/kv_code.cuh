// Page code v3 as the GPU reads it: the tile's layout, its loads, the decode templates that rebuild a lane's MMA
// operands from the L and hi planes, and the escape entries (where a value sits, what the fast path decoded for it,
// its true bits). Shared by decode attention, the tile reader (kv_attention.cuh) and the page writer (kv_write.cuh);
// the format is docs/format.md section 2, glyd_engine/format/kv_page.py the torch reference. Included by kv_pages.cu,
// after its build constants (HEAD, CODE_BITS, RESERVE, TPP).
#pragma once
#include "ptx.cuh"

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

static_assert(D == 64 || D == 128, "head size 64 or 128");
static_assert(CB == 3 || CB == 4, "3- or 4-bit codes");
static_assert(TILE_BYTES % 16 == 0, "tiles are whole 16-byte units");

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
