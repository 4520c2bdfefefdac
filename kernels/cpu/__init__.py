"""Prism's x86 CPU kernels, one C++ library built on first use: the exact integer GEMMs (exact_gemm.py,
csrc/exact_gemm.cpp), the decoder's row-wise passes (rowwise.py, csrc/rowwise.cpp) and those a GEMM's
quantiser runs in its own pass (prologues.py), tree attention (tree_attention.py,
csrc/tree_attention.cpp), the calibration's float64 steps (calibration.py, csrc/calibration.cpp), and the CPU
features that decide which of them run here (features.py)."""
