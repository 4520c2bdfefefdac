"""Which version of the kernels this layer calls, for the calibration cache's key: the calibration
forward runs Prism's CPU kernels, so an edit there can move the activations GPTQ and SmoothQuant
measure. Its own module so that importing the model package (the lean tokenizer stub reads
model.spec) does not import kernels."""
import hashlib
from pathlib import Path

import kernels
from kernels.cpu import exact_gemm

KERNELS_ROOT = Path(kernels.__file__).resolve().parent


def kernels_version() -> str:
    """The C++ library's name (a hash of every file in its source folder and of its compile flags)
    and a hash of the kernels' Python."""
    digest = hashlib.sha256(exact_gemm.library_name().encode())
    for path in sorted(KERNELS_ROOT.rglob("*.py")):
        digest.update(str(path.relative_to(KERNELS_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
