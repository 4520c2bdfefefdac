"""OpenAI Triton-lang kernels for Prism's GPU path, each with a torch reference of identical semantics.

    int8_gemm.py       int8 x int8 -> int32, dequantisation fused into the epilogue, no split-K
    tree_attention.py  attention over a packed forest of shared prefixes, cascade style
    gpu_check.py       both kernels at realistic sizes on a CUDA device: correctness and speed

On CPU-only machines the tests run the kernels through Triton's interpreter (TRITON_INTERPRET=1).
"""
