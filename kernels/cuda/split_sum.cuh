// The end of a matmul block past 16 rows of x (matmul_wide.cu, matmul_wgmma.cu): each warp holds the sums of one
// 16-row tile of W for 8 MT rows of x in the m16n8 accumulator layout (C[g + 8h][2t + r] of x-row tile mt is
// y[8 mt + 2t + r][16 tile + g + 8h]). With K split between blockIdx.y's blocks each split writes its fp32 sums and
// the last split of the tile group to finish (a counter) adds them in split order: the same bits on every run.
#pragma once
#include "fragment_code.cuh"

template <int MT_, int WT_>
__device__ __forceinline__ void finish_tiles(const float (&acc)[MT_][4], bool live, int tile, u16* __restrict__ y,
                                             const u16* __restrict__ bias, float* __restrict__ part,
                                             int* __restrict__ count, int M, int N, int has_bias) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int S = gridDim.y, s = blockIdx.y;
  if (S == 1) {
    if (!live) return;
#pragma unroll
    for (int mt = 0; mt < MT_; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 8 * mt + 2 * t + (i & 1), row = 16 * tile + g + 8 * (i >> 1);
        if (m < M) y[size_t(m) * N + row] = to_bf16(acc[mt][i] + (has_bias ? bf(bias[row]) : 0.f));
      }
    return;
  }
  if (live) {
#pragma unroll
    for (int mt = 0; mt < MT_; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 8 * mt + 2 * t + (i & 1), row = 16 * tile + g + 8 * (i >> 1);
        if (m < M) part[(size_t(s) * M + m) * N + row] = acc[mt][i];
      }
  }
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) last = atomicAdd(count + blockIdx.x, 1) == S - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other splits' sums, published before their counts, are visible from here
  // four rows a thread a round, ROUNDS rounds' loads issued before their sums (each an L2 round trip otherwise)
  constexpr int ROUNDS = 4, THREADS = WT_ * 32;
  const int row0 = 16 * blockIdx.x * WT_, quads = min(16 * WT_, N - row0) >> 2;
  for (int idx0 = threadIdx.x; idx0 < M * quads; idx0 += ROUNDS * THREADS) {
    float4 v[ROUNDS];
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) v[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int si = 0; si < S; ++si) {
      float4 p[ROUNDS];
#pragma unroll
      for (int r = 0; r < ROUNDS; ++r) {
        const int idx = idx0 + r * THREADS, m = idx / quads, row = row0 + 4 * (idx % quads);
        p[r] = idx < M * quads ? __ldcg(reinterpret_cast<const float4*>(part + (size_t(si) * M + m) * N + row))
                               : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int r = 0; r < ROUNDS; ++r) v[r].x += p[r].x, v[r].y += p[r].y, v[r].z += p[r].z, v[r].w += p[r].w;
    }
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
      const int idx = idx0 + r * THREADS, m = idx / quads, row = row0 + 4 * (idx % quads);
      if (idx >= M * quads) continue;
      const float b[4] = {has_bias ? bf(bias[row]) : 0.f, has_bias ? bf(bias[row + 1]) : 0.f,
                          has_bias ? bf(bias[row + 2]) : 0.f, has_bias ? bf(bias[row + 3]) : 0.f};
      const u32 lo2 = u32(to_bf16(v[r].x + b[0])) | u32(to_bf16(v[r].y + b[1])) << 16;
      const u32 hi2 = u32(to_bf16(v[r].z + b[2])) | u32(to_bf16(v[r].w + b[3])) << 16;
      *reinterpret_cast<uint2*>(y + size_t(m) * N + row) = make_uint2(lo2, hi2);
    }
  }
  if (threadIdx.x == 0) count[blockIdx.x] = 0;  // ready for the next launch (a CUDA graph replays this one)
}
