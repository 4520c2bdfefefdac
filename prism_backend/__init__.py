"""Prism's engine. Importing it first puts MKL into its strict reproducible mode (reproducibility.py),
which must happen before torch runs any float matrix product."""
from .reproducibility import enable_strict_blas

enable_strict_blas()
