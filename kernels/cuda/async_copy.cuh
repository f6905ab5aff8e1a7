// Shared-memory rings fed by cp.async and handed over by mbarriers, shared by the matmul kernels past 16 rows of x
// (matmul_wide.cu, matmul_wgmma.cu). Included by NVRTC from kernels/cuda (kernels/nvrtc.py).
#pragma once

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void cp16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
// the barrier at `bar` (shared address) counts one arrival when this thread's copies so far have landed
__device__ __forceinline__ void cp_arrive(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
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
// transaction bytes (announced with mbar_expect_tx): no thread waits for it, and fences do not either
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
#endif
