"""Where the kernels this layer calls keep their sources (Python and C++). The calibration cache
hashes them with the engine's own source: the calibration forward runs Prism's CPU kernels, so an
edit there can move the activations GPTQ and SmoothQuant measure. Its own module so that importing
the model package (the lean tokenizer stub reads model.spec) does not import kernels."""
from pathlib import Path

import kernels

KERNELS_ROOT = Path(kernels.__file__).resolve().parent
