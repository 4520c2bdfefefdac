"""Prism's own kernels, by target; each computes what a torch reference computes, to the bit.

    cpu/      the exact integer GEMMs for x86 CPUs (C++, built with g++ on first use, called via ctypes)
      exact_gemm.py     int16 x int16 (AVX2), uint8 x int8 (AVX-512 VNNI, AMX tiles) and base-128 digits
                        (AMX tiles; torch._int_mm's digit products) -> exact sums, with Prism's row
                        quantisation and dequantising epilogue fused in (csrc/exact_gemm.cpp)
      tree_attention.py attention over the packed forest in float32, one operation order on every x86
                        CPU kind (csrc/tree_attention.cpp, built into the same library)
      rowwise.py        the decoder's row-wise passes (RMSNorm, SwiGLU with its Hadamard rotation, rotary
                        embedding), the same bits as their torch ops (csrc/rowwise.cpp, same library)
      decoder_layer.py  a decoder layer in one call over those kernels (csrc/decoder_layer.cpp, same
                        library): the Python pipeline's steps and bits without the interpreter between them
      calibration.py    the calibration's float64 steps (GPTQ's column rounding, the offline rotation's
                        Hadamard transform), the same bits as their torch references (csrc/calibration.cpp)
      features.py       what this CPU runs (its flags), PRISM_CPU_ISA to make it act as an AVX2-only one
    triton/   OpenAI Triton-lang kernels for the GPU path
      exact_gemm.py     int8 x int8 -> exact int32 sums, dequantisation fused into the epilogue, no split-K
      tree_attention.py attention over a packed forest of shared prefixes, cascade style
      gpu_check.py      both at realistic sizes on a CUDA device: correctness and speed

The engine's exact integer product (prism_backend/model/exact_matmul.py) picks among the CPU kernels,
torch._int_mm and exact float GEMMs; only prism_backend.model imports this package, and it imports
nothing of Prism's. On CPU-only machines the tests run the Triton-lang kernels through Triton's
interpreter (TRITON_INTERPRET=1, set before any kernels.triton module is imported); the packages'
__init__ files import none of their modules, so importing kernels.cpu never defines a Triton kernel.
"""
