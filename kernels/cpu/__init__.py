"""Exact integer GEMMs for x86 CPUs (exact_gemm.py, C++ in csrc/exact_gemm.cpp) and the CPU
features that decide which of them run here (features.py)."""
