// The fragment-order weight code's decode step and escape walk, shared by the Glyd matmul kernels (matmul.cu:
// 1-16 rows of x, matmul_wide.cu and matmul_wgmma.cu: 17-128); the PTX primitives they use are in
// ptx.cuh. Included by NVRTC from kernels/cuda (kernels/nvrtc.py).
#pragma once

#include "ptx.cuh"

#define CHUNK_U4 96u  // 16-byte units of a (16-row tile, 64-column chunk): planes L(g), L(g+8), H; 32 lanes each
#define HMASK 0x87878787u
#define GROUP_CHUNKS 8  // colptr's column groups (format/fragment_weight.py GROUP_COLS): 512 columns

// W is read once: stream it past L1 (ld_stream). x is read by every warp of the block: keep it there.
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
