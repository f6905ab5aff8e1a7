// The Glyd matmul past 16 rows of x on Hopper (sm_90a; it takes 1-128): y = x W^T (+ bias), W in the fragment-order
// weight code (fragment_code.cuh, docs/format.md section 4.1), decoded in registers straight into the A operand of
// the warpgroup MMA (`wgmma.mma_async`, A from registers, B = x from shared memory). Compiled at run time by NVRTC
// (kernels/nvrtc.py) with -D MT (8-row tiles of x: 1, 2, 4, 8 or 16; the MMA's N is 8 MT), WG (warpgroups a block,
// each 64 rows of W: four warps of one 16-row tile each), STAGES (chunks in the shared-memory ring), MIN_BLOCKS and
// XIMAGE.
//
// Why: with mma.sync (matmul_wide.cu) every warp loads x's B registers and runs MT MMAs a 16-column step; one
// warpgroup MMA a step reads x from shared memory itself, at the tensor cores' full rate, with far fewer
// instructions a chunk.
//
// x's chunk is stored for the MMA in 128-byte-swizzled K-major rows, its columns permuted to the fragment code's
// order: the code gives lane 4 g + t columns 16 t + 4 j + (0..3) in step j, where an MMA's k index 2 t + e (+ 8)
// must be; so column 16 t + 4 j + 2 h + e sits at k position 16 j + 8 h + 2 t + e. With XIMAGE, glyd_mm_x_image
// first writes each chunk of x as that exact stage image, and a stage fills by bulk copies only (W a warp, x by
// warp 0); without, the block's threads load x a chunk ahead into registers (16 bytes a unit) and store it in
// 4-byte pairs into the ring, and each warp's chunk of W arrives by a bulk copy. Stages are handed over by `full`
// and `empty` mbarriers; a stage is released when the MMAs that read it are complete (wgmma.wait_group 1: one
// chunk's MMAs stay in flight while the next chunk decodes).
//
// Escapes are patched into the A registers before the MMA (the decoded value's exponent bits XORed to the true
// ones), so the product uses W exactly and no x values are read for them. K may be split between blockIdx.y's
// blocks at 512-column boundaries (`colptr`), their sums added in split order (split_sum.cuh).

#include "fragment_code.cuh"
#include "split_sum.cuh"

#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "matmul_wgmma.cu needs Hopper's sm_90a target (warpgroup MMA); other GPUs run matmul_wide.cu (matmul_cuda.has_wgmma)"
#endif

#ifndef MT
#define MT 8
#endif
#ifndef WG
#define WG 1
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef XIMAGE
#define XIMAGE 0  // 1: x arrives as its chunks' stage images (glyd_mm_x_image), one bulk copy a stage
#endif
#define NT (128 * WG)
#define WT (4 * WG)
#define XROWS (8 * MT)
#define X_BYTES (XROWS * 128)  // a stage's x: XROWS rows of 64 columns, 128-byte swizzle atoms of 8 rows
#define W_BYTES (WT * 1536)    // a stage's W: each warp's (tile, chunk), lane-major as in global memory
#define STAGE_BYTES (X_BYTES + W_BYTES)
// x's copy offsets held in registers for the loop (up to 64 rows: 3-5% faster; at 128 rows the registers cost a
// block a multiprocessor and the compiler's recomputation is faster)
#define KEEP_OFFSETS (MT <= 8)
#define AHEAD (STAGES - 2)  // chunks loaded ahead of the one the MMAs read (one more is in flight in the MMAs)

static_assert(MT == 1 || MT == 2 || MT == 4 || MT == 8 || MT == 16, "1-8, 9-16, 17-32, 33-64 or 65-128 rows of x");
static_assert(STAGES >= 3 && STAGES <= 6, "3-6 ring stages");
static_assert(STAGE_BYTES % 1024 == 0, "stages start on swizzle-atom boundaries");

// Where x's column pair (16 w + 2 ku, + 1) of row m sits in a stage: 16-byte unit ku of the row (k positions
// 8 ku .. 8 ku + 7, the unit swizzled by the row), word w. The fragment code puts column 16 t + 4 j + 2 h + e at k
// position 16 j + 8 h + 2 t + e.
__device__ __forceinline__ u32 x_offset(int m, int ku, int w) {
  return u32((m >> 3) * 1024 + (m & 7) * 128 + ((ku ^ (m & 7)) << 4) + 4 * w);
}

// x's chunks as the images of a stage's x: chunk c's X_BYTES at img + c X_BYTES, rows past M zero. A thread a 16-byte
// unit of an image, its four words gathered from x. Grid: (chunks, 8 XROWS / 128).
extern "C" __global__ void __launch_bounds__(128) glyd_mm_x_image(uint4* __restrict__ img, const u16* __restrict__ x,
                                                                  int M, int ldx) {
  const int c = blockIdx.x, v = blockIdx.y * 128 + threadIdx.x;  // the unit at byte 16 v of the image
  if (v >= XROWS * 8) return;
  const int m = (v >> 6) * 8 + ((v >> 3) & 7), ku = (v & 7) ^ (m & 7);
  uint4 out = make_uint4(0u, 0u, 0u, 0u);
  if (m < M) {
    const u32* row = reinterpret_cast<const u32*>(x + size_t(m) * ldx + 64 * c + 2 * ku);
    out = make_uint4(__ldg(row), __ldg(row + 8), __ldg(row + 16), __ldg(row + 24));
  }
  img[size_t(c) * (X_BYTES / 16) + v] = out;
}

#define F4(m) "+f"(d[m][0]), "+f"(d[m][1]), "+f"(d[m][2]), "+f"(d[m][3])
#if MT == 1
#define WG_N "8"
#define WG_D "{%0,%1,%2,%3}"
#define WG_A "{%4,%5,%6,%7}"
#define WG_B "%8"
#define WG_P "%9"
#define WG_OUT(d) F4(0)
#elif MT == 2
#define WG_N "16"
#define WG_D "{%0,%1,%2,%3,%4,%5,%6,%7}"
#define WG_A "{%8,%9,%10,%11}"
#define WG_B "%12"
#define WG_P "%13"
#define WG_OUT(d) F4(0), F4(1)
#elif MT == 4
#define WG_N "32"
#define WG_D "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define WG_A "{%16,%17,%18,%19}"
#define WG_B "%20"
#define WG_P "%21"
#define WG_OUT(d) F4(0), F4(1), F4(2), F4(3)
#elif MT == 8
#define WG_N "64"
#define WG_D "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
  "%27,%28,%29,%30,%31}"
#define WG_A "{%32,%33,%34,%35}"
#define WG_B "%36"
#define WG_P "%37"
#define WG_OUT(d) F4(0), F4(1), F4(2), F4(3), F4(4), F4(5), F4(6), F4(7)
#elif MT == 16
#define WG_N "128"
#define WG_D "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
  "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51," \
  "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define WG_A "{%64,%65,%66,%67}"
#define WG_B "%68"
#define WG_P "%69"
#define WG_OUT(d) F4(0), F4(1), F4(2), F4(3), F4(4), F4(5), F4(6), F4(7), F4(8), F4(9), F4(10), F4(11), F4(12), F4(13), F4(14), F4(15)
#endif

// d += A (64 x 16, this thread's fragment a0..a3) * B (16 x 8 MT, shared memory at `desc`)
__device__ __forceinline__ void wgmma(float (&d)[MT][4], u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, " WG_P ", 0; wgmma.mma_async.sync.aligned.m64n" WG_N
               "k16.f32.bf16.bf16 " WG_D ", " WG_A ", " WG_B ", p, 1, 1, 0; }"
               : WG_OUT(d)
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}
// the accumulators are read after the MMAs complete, not where the compiler last saw them written
__device__ __forceinline__ void pin(float (&d)[MT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) asm volatile("" : "+f"(d[mt][0]), "+f"(d[mt][1]), "+f"(d[mt][2]), "+f"(d[mt][3])::"memory");
}
__device__ __forceinline__ void keep(const u32 (&a)[4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) asm volatile("" ::"r"(a[j][0]), "r"(a[j][1]), "r"(a[j][2]), "r"(a[j][3]) : "memory");
}
// K-major, 128-byte swizzle, 8-row groups 1,024 bytes apart (the leading offset is unused by this mode)
__device__ __forceinline__ unsigned long long x_desc(u32 saddr) {
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void sts32(u32 addr, u32 v) { asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v)); }

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS) glyd_mm_wgmma(
    u16* __restrict__ y, const uint4* __restrict__ w, const u16* __restrict__ x, const u16* __restrict__ bias,
    const int* __restrict__ rowptr, const u16* __restrict__ colptr, const u32* __restrict__ esc,
    float* __restrict__ part, int* __restrict__ count,
    int M, int N, int K, int ldx, int lo, int has_bias) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];
  const u32 raw = smem_u32(smem_raw), sbase = (raw + 1023u) & ~1023u;  // swizzle atoms start on 1 KiB boundaries
  const unsigned char* smem = smem_raw + (sbase - raw);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  const int chunks = K >> 6, tiles = N >> 4, groups = (chunks + GROUP_CHUNKS - 1) / GROUP_CHUNKS;
  const int S = gridDim.y, s = blockIdx.y;
  const int q0 = s * groups / S, q1 = (s + 1) * groups / S;  // this split's column groups
  const int c0 = q0 * GROUP_CHUNKS, c1 = min(chunks, q1 * GROUP_CHUNKS), nc = c1 - c0;
  const int tile = blockIdx.x * WT + warp;
  const bool live = tile < tiles;

#if !XIMAGE
  // x's 16-byte units: unit u is row u / 8, columns 8 (u % 8) + (0..7), the same units every chunk (rows past M read
  // row M - 1: they only reach columns of the product that are never written). Its pairs p = 0..3 go to k unit
  // 4 (u % 2) + p of the row, byte 4 ((u % 8) / 2), the unit swizzled by the row: offset xs ^ (p << 4) in a stage.
  constexpr int XU = (XROWS * 8 + NT - 1) / NT;
  constexpr bool XALL = XROWS * 8 % NT == 0;  // every thread has XU units
  const u16* xc = x + 64 * c0;  // the next chunk to fetch
  int xo[XU];
  u32 xs[XU];
#pragma unroll
  for (int r = 0; r < XU; ++r) {
    const int u = threadIdx.x + r * NT, m = u >> 3, k8 = u & 7;
    xo[r] = min(m, M - 1) * ldx + 8 * k8;
    xs[r] = x_offset(m, 4 * (k8 & 1), k8 >> 1);
#if KEEP_OFFSETS
    asm volatile("" : "+r"(xo[r]), "+r"(xs[r]));  // opaque: computed once, not again every chunk
#endif
  }
  uint4 xr[XU];
  auto fetch = [&]() {  // the next chunk of x into registers
#pragma unroll
    for (int r = 0; r < XU; ++r)
      if (XALL || threadIdx.x + r * NT < XROWS * 8) xr[r] = __ldg(reinterpret_cast<const uint4*>(xc + xo[r]));
    xc += 64;
  };
  auto put = [&](int st) {  // the fetched chunk into stage st, in the MMA's order
    const u32 base = sbase + u32(st * STAGE_BYTES);
#pragma unroll
    for (int r = 0; r < XU; ++r)
      if (XALL || threadIdx.x + r * NT < XROWS * 8) {
        const u32 at = base + xs[r];
#pragma unroll
        for (int p = 0; p < 4; ++p) sts32(at ^ u32(p << 4), word(xr[r], p));
      }
  };
#endif
  const uint4* wnext = w + size_t(live ? tile : 0) * chunks * CHUNK_U4 + size_t(c0) * CHUNK_U4;
#if !XIMAGE
  auto load_w = [&](int st, u32 bar) {  // the warp's next chunk of W (1,536 bytes) into stage st, by its lane 0
    if (live && lane == 0) {
      mbar_expect_tx(bar, 1536);
      cp_bulk(sbase + u32(st * STAGE_BYTES) + X_BYTES + warp * 1536, wnext, 1536, bar);
    }
    wnext += CHUNK_U4;
  };
#endif

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

  // each lane's two rows' escapes in this split (h = 0: row g, 1: row g + 8). Two variables, not an array: an array
  // indexed by h would live in local memory.
  EscapeWalk wk0{0, 0, ~0u, ~0u}, wk1 = wk0;
  if (live) {
    wk0 = walk_from(rowptr, colptr, esc, 16 * tile + g, q0, q1, groups, N, true);
    wk1 = walk_from(rowptr, colptr, esc, 16 * tile + g + 8, q0, q1, groups, N, true);
  }
  const u32 kb = u32(lo >> 1) * 0x01010101u, lo_bits = u32(lo) << 7;
  const unsigned long long desc0 = x_desc(sbase);

  const u32 full0 = smem_u32(bars), empty0 = full0 + 8 * STAGES;
  if (threadIdx.x == 0) {
    for (int st = 0; st < STAGES; ++st) mbar_init(full0 + 8 * st, XIMAGE ? WT : NT), mbar_init(empty0 + 8 * st, NT);
    mbar_init_visible();
  }
  __syncthreads();
#if XIMAGE
  // With x's images, lane 0 of each warp fills the stage: its W chunk and (warp 0) x's image, all bulk copies
  // counted in bytes; the stage is full after one arrival a warp.
  const unsigned char* ximg = reinterpret_cast<const unsigned char*>(x) + size_t(c0) * X_BYTES;
  auto produce = [&](int p) {
    const int ps = p % STAGES;
    const u32 bar = full0 + 8 * ps;
    if (lane == 0) {
      if (p >= STAGES) mbar_wait(empty0 + 8 * ps, ((p / STAGES) - 1) & 1);  // chunk p - STAGES is released
      const u32 bytes = (live ? 1536u : 0u) + (warp == 0 ? u32(X_BYTES) : 0u);
      if (bytes) mbar_expect_tx(bar, bytes);
      if (warp == 0) cp_bulk(sbase + u32(ps * STAGE_BYTES), ximg + size_t(p) * X_BYTES, X_BYTES, bar);
      if (live)
        cp_bulk(sbase + u32(ps * STAGE_BYTES) + X_BYTES + warp * 1536, wnext + size_t(p) * CHUNK_U4, 1536, bar);
      mbar_arrive(bar);
    }
  };
#else
  // a stage is full when its W chunks have landed (each warp's bulk copy, counted in bytes) and every thread's x
  // stores are visible to the MMA's async proxy (a fence, then an arrival). The fence waits for this thread's
  // outstanding memory operations, so it comes before the next chunk's loads are issued.
  auto produce = [&](int p) {  // chunk p into its stage
    const int ps = p % STAGES;
    const u32 bar = full0 + 8 * ps;
    if (p >= STAGES) mbar_wait(empty0 + 8 * ps, ((p / STAGES) - 1) & 1);  // chunk p - STAGES is released
    load_w(ps, bar);
    put(ps);
    fence_proxy_async();
    mbar_arrive(bar);
    if (p + 1 < nc) fetch();
  };
  if (nc > 0) fetch();
#endif
#pragma unroll 1
  for (int p = 0; p < AHEAD && p < nc; ++p) produce(p);

  // A registers are read by the MMAs after they issue: chunk i's stay untouched until the wait that follows chunk
  // i + 1's MMAs, so chunks alternate between two register sets, each kept alive (`keep`) until that wait.
  auto chunk = [&](int i, u32 (&a)[4][4], u32 (&prev)[4][4]) {
    if (i + AHEAD < nc) produce(i + AHEAD);  // refill the stage chunk i - 2 used (released last iteration)
    const int st = i % STAGES;
    mbar_wait(full0 + 8 * st, (i / STAGES) & 1);
    if (live) {
      const uint4* ws = reinterpret_cast<const uint4*>(smem + st * STAGE_BYTES + X_BYTES + warp * 1536) + lane;
      const uint4 l0 = ws[0], l1 = ws[32], hw = ws[64];
#pragma unroll
      for (int j = 0; j < 4; ++j) decode_step(word(l0, j), word(l1, j), word(hw, j), kb, a[j][0], a[j][1], a[j][2], a[j][3]);
      // the chunk's escapes of rows g and g + 8, the earlier column first: the lane holding the value XORs its
      // exponent bits to the true ones (register 4 j + 2 (c / 2 % 2) + h, half c % 2 of column c within the lane's 16)
      const u32 cend = u32(64 * (c0 + i + 1)), cbase = u32(64 * (c0 + i));
#pragma unroll 1
      while (true) {
        const int h = (wk1.cur >> 16) < (wk0.cur >> 16);
        const u32 ent = h ? wk1.cur : wk0.cur;
        if ((ent >> 16) >= cend) break;
        const u32 col = (ent >> 16) - cbase;
        if (int(col >> 4) == t) {
          const u32 diff = (ent ^ ((ent & 0x807Fu) | lo_bits)) & 0xFFFFu, v = diff << (16 * (col & 1));
          switch (4 * int((col >> 2) & 3) + 2 * int((col >> 1) & 1) + h) {
#define PATCH(j, r) \
  case 4 * j + r: a[j][r] ^= v; break;
            PATCH(0, 0) PATCH(0, 1) PATCH(0, 2) PATCH(0, 3) PATCH(1, 0) PATCH(1, 1) PATCH(1, 2) PATCH(1, 3)
            PATCH(2, 0) PATCH(2, 1) PATCH(2, 2) PATCH(2, 3) PATCH(3, 0) PATCH(3, 1) PATCH(3, 2) PATCH(3, 3)
#undef PATCH
          }
        }
        if (h)
          walk_step(wk1, esc);
        else
          walk_step(wk0, esc);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = a[j][2] = a[j][3] = 0u;
    }
    wg_fence();
    const unsigned long long desc = desc0 + (u32(st * STAGE_BYTES) >> 4);
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma(acc, a[j][0], a[j][1], a[j][2], a[j][3], desc + 2 * j);  // k units 2j, 2j+1
    wg_commit();
    wg_wait<1>();  // chunk i - 1's MMAs are complete: its registers and stage are free
    keep(prev);
    if (i > 0) mbar_arrive(empty0 + 8 * ((i - 1) % STAGES));
  };
  u32 a0[4][4], a1[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) a1[j][0] = a1[j][1] = a1[j][2] = a1[j][3] = 0u;
#pragma unroll 1
  for (int i = 0; i < nc; i += 2) {
    chunk(i, a0, a1);
    if (i + 1 < nc) chunk(i + 1, a1, a0);
  }
  wg_wait<0>();
  keep(a0);
  keep(a1);
  pin(acc);
  finish_tiles<MT, WT>(acc, live, tile, y, bias, part, count, M, N, has_bias);
}
