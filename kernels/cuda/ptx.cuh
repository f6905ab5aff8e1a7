// PTX primitives shared by the KV page kernels (kv_pages.cu) and the Glyd matmuls (matmul*.cu): byte and bf16
// operations, the bf16 tensor-core MMA, loads past L1, and the copies and mbarriers that fill shared-memory rings.
// Included by NVRTC from kernels/cuda (kernels/nvrtc.py). Shared-memory operands are 32-bit shared addresses
// (smem_u32). Instructions of sm_90 and newer (bulk copies, their mbarrier transactions, proxy fences) are defined
// only there; the callers choose their portable path elsewhere.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

// ---- bytes and bf16 ----------------------------------------------------------------------------------------------
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
// two floats rounded to a bf16 pair: lo in the low half
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// ---- tensor cores ------------------------------------------------------------------------------------------------
// c += A·B, mma.sync.m16n8k16 (sm_80+), bf16 in, fp32 accumulate; lane 4g + t holds the usual fragments
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// the warp's 8x8 matrix of 16-bit values (a register a lane) transposed
__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// ---- global memory -----------------------------------------------------------------------------------------------
// read-only data read once: streamed past L1
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// ---- copies into shared memory and mbarriers ---------------------------------------------------------------------
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// 16 bytes global -> shared by this thread (cp.async, sm_80+), in the thread's current commit group
__device__ __forceinline__ void cp16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp16(void* dst, const void* src) { cp16(smem_u32(dst), src); }
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
// until at most N of this thread's commit groups are still in flight
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
// the barrier at `bar` counts one arrival when this thread's copies so far have landed
__device__ __forceinline__ void cp_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile("{ .reg .pred p; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra WAIT_%=; }"
               ::"r"(bar), "r"(parity) : "memory");
#else
  asm volatile("{ .reg .pred p; WAIT_%=: mbarrier.test_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra WAIT_%=; }"
               ::"r"(bar), "r"(parity) : "memory");
#endif
}
#if __CUDA_ARCH__ >= 900
// barriers just initialised are visible to the bulk-copy engine's transaction counts (after mbar_init, before any
// copy that completes on them)
__device__ __forceinline__ void mbar_init_visible() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// `bytes` (a multiple of 16) from global to shared memory by the bulk-copy engine, counted by the barrier at `bar` as
// transaction bytes (announced with mbar_expect_tx or mbar_arrive_expect_tx): no thread waits for it
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_bulk(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// this thread's ordinary shared-memory accesses ordered before later async-proxy ones (bulk copies, warpgroup MMAs)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif
