"""OpenAI Triton-lang kernels for Prism's GPU path (exact int8 GEMM, tree attention) and their GPU
check. Nothing is imported here: a kernel is bound to Triton's interpreter or compiler when its module
is imported, so TRITON_INTERPRET must be set before (tests/conftest.py does it without a GPU).

Inside this package `import triton` is still OpenAI's triton: imports are absolute."""
