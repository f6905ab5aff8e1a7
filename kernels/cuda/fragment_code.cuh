// The fragment-order weight code's decode and the tensor-core step, shared by the Glyd matmul kernels (matmul.cu:
// 1-16 rows of x, matmul_wide.cu: 17-128). Included by NVRTC from kernels/cuda (kernels/nvrtc.py).
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;

#define CHUNK_U4 96u  // 16-byte units of a (16-row tile, 64-column chunk): planes L(g), L(g+8), H; 32 lanes each
#define HMASK 0x87878787u
#define GROUP_CHUNKS 8  // colptr's column groups (format/fragment_weight.py GROUP_COLS): 512 columns

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}
__device__ __forceinline__ u32 rotr(u32 x, int n) { return __funnelshift_r(x, x, n); }
__device__ __forceinline__ float bf(u32 bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ u16 to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// W is read once: stream it past L1. x is read by every warp of the block: keep it there.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}
__device__ __forceinline__ u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// One row's escape walk over a K split's column groups [q0, q1) of `groups` (rowptr and colptr, docs/format.md
// section 4.1): the entry at e and the one after it, loaded ahead; ~0u ends a walk (an idle warp's at once).
struct EscapeWalk {
  int e, end;
  u32 cur, nxt;
};
__device__ __forceinline__ EscapeWalk walk_from(const int* __restrict__ rowptr, const u16* __restrict__ colptr,
                                                const u32* __restrict__ esc, int row, int q0, int q1, int groups,
                                                int N, bool live) {
  EscapeWalk w;
  const int first = live ? __ldg(rowptr + row) : 0;  // colptr[q - 1]: the row's escapes below column 512 q
  w.e = first + (live && q0 > 0 ? int(__ldg(colptr + size_t(q0 - 1) * N + row)) : 0);
  w.end = !live ? 0 : q1 < groups ? first + int(__ldg(colptr + size_t(q1 - 1) * N + row)) : __ldg(rowptr + row + 1);
  w.cur = w.e < w.end ? __ldg(esc + w.e) : ~0u;
  w.nxt = w.e + 1 < w.end ? __ldg(esc + w.e + 1) : ~0u;
  return w;
}
__device__ __forceinline__ void walk_step(EscapeWalk& w, const u32* __restrict__ esc) {
  ++w.e;
  w.cur = w.nxt;
  w.nxt = w.e + 1 < w.end ? __ldg(esc + w.e + 1) : ~0u;
}

// The four A registers of step j from a chunk's three words.
__device__ __forceinline__ void decode_step(u32 lg, u32 lg8, u32 hw, u32 kb, u32& a0, u32& a1, u32& a2, u32& a3) {
  const u32 ha = (hw & HMASK) + kb, hb = (rotr(hw, 4) & HMASK) + kb;
  a0 = prmt(lg, ha, 0x5140);   // row g, columns 4j, 4j+1
  a1 = prmt(lg8, hb, 0x5140);  // row g+8
  a2 = prmt(lg, ha, 0x7362);   // row g, columns 4j+2, 4j+3
  a3 = prmt(lg8, hb, 0x7362);
}
