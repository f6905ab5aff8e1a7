"""GPU kernels: the KV page code's (CUDA C++, compiled at run time by NVRTC) and the Glyd matmul's (Triton).

- `kv_cuda`: decode attention over compressed pages, the page writer and a tile reader (kernels/cuda/kv_pages.cu).
- `kv_layer.KVLayer`: one attention layer's pages driven by them (what the vLLM backend calls on CUDA), with a
  torch implementation of the same interface for machines without a GPU.
- `nvrtc`: compiling, caching and launching the CUDA sources.
- `resident_linear`: the Glyd matmul, weight tiles decoded on chip (Triton).

The torch reference of the page code is `glyd_engine.format.kv_page` (write, read).
"""
