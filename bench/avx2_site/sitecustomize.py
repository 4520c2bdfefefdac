"""Makes torch's CPU probes answer as an AVX2-only CPU's in every Python process of a benchmark forced
onto the AVX2 path (bench/forced_avx2.py puts this folder first on PYTHONPATH; Python imports
`sitecustomize` at start).

vLLM's CPU build asks `torch.cpu._is_avx512_supported()` and its kin which kernel library to load
(`_C_AVX2` or an AVX-512 one) and which attention kernel to run; torch answers from the CPU itself,
whatever ATEN_CPU_CAPABILITY says. Under PRISM_CPU_ISA=avx2 each probe is replaced by one that says
False the moment `torch` has been imported -- lazily, so a process that never imports torch (Triton's
tokenizer stub, pip) does not pay for it. Prism's own kernels ask kernels/cpu/features.py instead,
which PRISM_CPU_ISA caps by itself.
"""
import importlib.abc
import importlib.machinery
import os
import sys

PROBES = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
          "_is_amx_tile_supported", "_is_amx_fp16_supported")


class _ProbesOffAfterTorch(importlib.abc.MetaPathFinder):
    """Finds `torch` as Python would, and wraps its loading so that its CPU probes say False after it.
    It stays on sys.meta_path: a library may ask for torch's spec without importing it
    (`importlib.util.find_spec`), and the import that follows asks again."""

    def find_spec(self, name, path, target=None):
        if name != "torch" or "torch" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for probe in PROBES:
                if hasattr(module.cpu, probe):
                    setattr(module.cpu, probe, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("PRISM_CPU_ISA") == "avx2":
    sys.meta_path.insert(0, _ProbesOffAfterTorch())
