// The Glyd matmul for 17-128 rows of x (sm_80+): y = x W^T (+ bias), W in the fragment-order weight code
// (fragment_code.cuh, docs/format.md section 4.1). Compiled at run time by NVRTC (kernels/nvrtc.py) with -D MT (8-row
// tiles of x: 1, 2, 4, 8 or 16), WT (warps a block, each one 16-row tile of W), STAGES (chunks in the shared-memory
// ring), MIN_BLOCKS (blocks a multiprocessor) and PIPE (1: the ring's stages handed over by mbarriers; 0: a block
// barrier a chunk).
//
// Past 16 rows the kernel that gives each block one tile of W and all of K (matmul.cu) reads all of x once a block:
// at 64 rows that is five times W's bytes through L2. Here a block's WT warps hold WT tiles side by side and share
// each 64-column chunk of x, which the block copies once into shared memory (cp.async) while its warps copy their
// chunks of W into the same ring stage; a warp decodes its chunk into the A registers of the MMAs (9 integer
// instructions for 8 values, as in matmul.cu) and reads x's B registers from shared memory. So L2 carries x once for
// every 16 WT rows of W. K is split between blockIdx.y's blocks at 512-column boundaries (`colptr`'s groups) so that
// small N still fills the GPU; each split writes its fp32 sums and the last split of a tile group to finish (a
// counter) adds them in split order: the same bits on every run.
//
// Escapes are added per chunk from the x already in shared memory: lane 4 g + t walks rows g and g + 8 of its tile
// (their entries in the split's columns: rowptr and colptr), two entries ahead, and adds (true - decoded) x to the
// 2 MT sums it holds for that row. The walk costs a compare a row a chunk when a chunk holds none of the row's escapes.

#include "fragment_code.cuh"
#include "split_sum.cuh"

#ifndef MT
#define MT 8
#endif
#ifndef WT
#define WT 8
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef PIPE
#define PIPE 1  // the ring's stages handed over by mbarriers (0: a block barrier a chunk)
#endif
#define XROWS (8 * MT)
#define X_BYTES (XROWS * 128)  // a stage's x: XROWS rows x 64 bf16 columns, 16-byte units swizzled by row parity
#define W_BYTES (WT * 1536)    // a stage's W: each warp's (tile, chunk), lane-major as in global memory
#define STAGE_BYTES (X_BYTES + W_BYTES)

static_assert(MT == 1 || MT == 2 || MT == 4 || MT == 8 || MT == 16, "1-8, 9-16, 17-32, 33-64 or 65-128 rows of x");
static_assert(STAGES >= 2 && STAGES <= 6, "2-6 ring stages");

// byte offset of x[m][col] in a stage (col < 64): unit col / 8 of row m, flipped by m's parity so that the eight
// lanes of a 16-byte load phase (rows g, g + 1; units 2t (+1)) hit eight different bank groups
__device__ __forceinline__ int xoff(int m, int unit) { return m * 128 + ((unit ^ (m & 1)) << 4); }

extern "C" __global__ void __launch_bounds__(WT * 32, MIN_BLOCKS) glyd_mm_wide(
    u16* __restrict__ y, const uint4* __restrict__ w, const u16* __restrict__ x, const u16* __restrict__ bias,
    const int* __restrict__ rowptr, const u16* __restrict__ colptr, const u32* __restrict__ esc,
    float* __restrict__ part, int* __restrict__ count,
    int M, int N, int K, int ldx, int lo, int has_bias) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  const int chunks = K >> 6, tiles = N >> 4, groups = (chunks + GROUP_CHUNKS - 1) / GROUP_CHUNKS;
  const int S = gridDim.y, s = blockIdx.y;
  const int q0 = s * groups / S, q1 = (s + 1) * groups / S;  // this split's column groups
  const int c0 = q0 * GROUP_CHUNKS, c1 = min(chunks, q1 * GROUP_CHUNKS), nc = c1 - c0;
  const int tile = blockIdx.x * WT + warp;
  const bool live = tile < tiles;
  const uint4* wsrc = w + size_t(live ? tile : 0) * chunks * CHUNK_U4 + lane;

  // the ring's copies: each thread's units of x are the same every chunk (offsets precomputed; rows past M are
  // left as they are: they only reach sums of those rows, which are never written)
  constexpr int XU = (XROWS * 8 + WT * 32 - 1) / (WT * 32);
  const u32 sbase = smem_u32(smem);
  int xsrc[XU];
  u32 xdst[XU];
#pragma unroll
  for (int r = 0; r < XU; ++r) {
    const int u = threadIdx.x + r * WT * 32, m = u >> 3;
    xsrc[r] = u < XROWS * 8 && m < M ? m * ldx + 8 * (u & 7) : -1;
    xdst[r] = u32(xoff(m, u & 7));
  }
  const u32 wdst = X_BYTES + warp * 1536 + lane * 16;
  auto load = [&](int c, int st) {  // chunk c of x and of each warp's tile into ring stage st
    const u32 base = sbase + u32(st * STAGE_BYTES);
    const u16* xc = x + 64 * c;
#pragma unroll
    for (int r = 0; r < XU; ++r)
      if (xsrc[r] >= 0) cp16(base + xdst[r], xc + xsrc[r]);
    if (live) {
      const uint4* src = wsrc + size_t(c) * CHUNK_U4;
      cp16(base + wdst, src);
      cp16(base + wdst + 512, src + 32);
      cp16(base + wdst + 1024, src + 64);
    }
  };

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

  EscapeWalk wk[2];  // each lane's two rows: g and g + 8
#pragma unroll
  for (int h = 0; h < 2; ++h) wk[h] = walk_from(rowptr, colptr, esc, 16 * tile + g + 8 * h, q0, q1, groups, N, live);
  const u32 kb = u32(lo >> 1) * 0x01010101u;

  auto consume = [&](int i) {  // chunk c0 + i from its ring stage: MMAs, then the chunk's escapes of both rows
    const unsigned char* xs = smem + (i % STAGES) * STAGE_BYTES;
    const uint4* ws = reinterpret_cast<const uint4*>(xs + X_BYTES + warp * 1536) + lane;
    const uint4 l0 = ws[0], l1 = ws[32], hw = ws[64];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint4 xb[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xb[mt] = *reinterpret_cast<const uint4*>(xs + xoff(8 * mt + g, 2 * t + half));
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        u32 a0, a1, a2, a3;
        const int j = 2 * half + jj;
        decode_step(word(l0, j), word(l1, j), word(hw, j), kb, a0, a1, a2, a3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma(acc[mt], a0, a1, a2, a3, word(xb[mt], 2 * jj), word(xb[mt], 2 * jj + 1));
      }
    }
    const u32 cend = u32(64 * (c0 + i + 1)), cbase = u32(64 * (c0 + i));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      while ((wk[h].cur >> 16) < cend) {
        const u32 col = (wk[h].cur >> 16) - cbase;
        const float delta = bf(wk[h].cur & 0xFFFFu) - bf((wk[h].cur & 0x807Fu) | (u32(lo) << 7));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int m = 8 * mt + 2 * t + r;
            const u16 xv = *reinterpret_cast<const u16*>(xs + xoff(m, col >> 3) + 2 * (col & 7));
            acc[mt][2 * h + r] = fmaf(delta, bf(xv), acc[mt][2 * h + r]);
          }
        walk_step(wk[h], esc);
      }
    }
  };

#if PIPE
  // each stage has a `full` barrier (every thread's copies into it have landed) and an `empty` one (every thread is
  // done with it): a warp waits only for the chunk it reads, and refills a stage after finishing the next chunk, so
  // a warp slowed by escapes holds the others up by at most a chunk
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];
  const u32 full0 = smem_u32(bars), empty0 = full0 + 8 * STAGES;
  if (threadIdx.x == 0)
    for (int st = 0; st < 2 * STAGES; ++st) mbar_init(full0 + 8 * st, WT * 32);
  __syncthreads();
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st)
    if (st < nc) load(c0 + st, st), cp_arrive(full0 + 8 * st);
#pragma unroll 1
  for (int i = 0; i < nc; ++i) {
    const int st = i % STAGES;
    if (live) {
      mbar_wait(full0 + 8 * st, (i / STAGES) & 1);
      consume(i);
    }
    mbar_arrive(empty0 + 8 * st);
    const int next = i + STAGES - 1;
    if (next < nc) {
      const int ns = next % STAGES;
      if (i > 0) mbar_wait(empty0 + 8 * ns, ((i - 1) / STAGES) & 1);  // every warp is done with chunk i - 1
      load(c0 + next, ns);
      cp_arrive(full0 + 8 * ns);
    }
  }
#else
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < nc) load(c0 + st, st);
    cp_commit();
  }
#pragma unroll 1
  for (int i = 0; i < nc; ++i) {
    cp_wait<STAGES - 2>();
    __syncthreads();  // chunk i has landed for every warp; every warp is done with chunk i - 1's stage
    if (i + STAGES - 1 < nc) load(c0 + i + STAGES - 1, (i + STAGES - 1) % STAGES);
    cp_commit();
    if (live) consume(i);
  }
#endif

  finish_tiles<MT, WT>(acc, live, tile, y, bias, part, count, M, N, has_bias);
}
