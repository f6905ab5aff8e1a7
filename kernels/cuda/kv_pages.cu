// Glyd KV page code v3 on NVIDIA GPUs (sm_80+): decode attention, the page writer and a tile reader. The one NVRTC
// translation unit of the KV kernels (kernels/kv_cuda.py loads it), compiled at run time (kernels/nvrtc.py) with -D
// HEAD (64 or 128), CODE_BITS (3 or 4), GQ (query heads a KV head, <= 8), RESERVE (escape-list entries a tile), TPP
// (tiles a page), WARPS (warps a decode block) and the decode switches RING, MIN_BLOCKS (kv_cuda.defines); the
// others keep their defaults. By role:
//   ptx.cuh           PTX primitives (shared with the matmul kernels)
//   kv_code.cuh       the tile layout, its loads, the decode templates and escape entries
//   kv_attention.cuh  decode attention, the merge of its splits and the tile reader (switches RING, BULK, PATCH,
//                     P_SPLIT, MIN_BLOCKS)
//   kv_write.cuh      the page writer (switch WMIN_BLOCKS)
// The format is docs/format.md section 2 and glyd_engine/format/kv_page.py (the torch reference).

#include "ptx.cuh"

#ifndef CODE_BITS
#define CODE_BITS 3
#endif

#include "kv_code.cuh"
#include "kv_attention.cuh"
#include "kv_write.cuh"

// Sizes of the dynamic shared memory the kernels above take (read once by the launcher).
extern "C" __global__ void kv_sizes(int* out) {
  out[0] = int(sizeof(Smem));
  out[1] = int(sizeof(WSmem));
}
