"""Linear projections: fp32 reference, and integer x integer (exact, batch-invariant).

INT8 scheme (W8A8, in passes):
  weights      symmetric per output channel, quantised once at load to integers W with
               |W| <= int_bound(weight_passes): 127 with 1 pass (plain int8), 8191 (13 bits) with 2,
               whose base-128 digits are two int8 passes (the second one is what the first missed).
               One pass leaves ~0.2% rounding in every weight, the same in every token: a slightly
               different model whose probabilities sit ~0.02 off fp32; two passes take that to ~1e-3.
  activations  symmetric per token at run time, likewise in `act_passes` passes (|X| <= int_bound).
  product      X @ W, the exact integer product (exact_matmul.py): every int8 pass of X times
               every int8 pass of W with int32 accumulation, combined in int64 -- or one exact
               int16, 8-bit or float product of the same integers (exact_matmul.py picks the
               fastest exact route for this CPU; the bits cannot differ) -- then dequantised in
               float64 as (acc * x_scale) * w_scale, rounded once to float32, plus the bias (fused
               into the CPU kernels, the same operations). On CUDA tensors the Triton-lang exact
               GEMM runs the int8 passes with the dequantisation fused into its epilogue (float32:
               close to, not bitwise equal to, the CPU's float64 one).
Every step is row-wise or exact, so a token's output bits never depend on the other rows.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kernels.cpu.prologues import Prologue, Rotary

from .exact_matmul import (PASS_BASE, ExactWeight, dequantize, int8_passes, int_bound, quantize_rows, round_to_grid,
                           symmetric_scale)

from ..config import ComputeSettings
from .layers import apply_prologue


class Fp32Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None):
        """group: a tp.TPGroup when this rank holds a slice of the input columns (row-parallel)."""
        self.weight, self.bias, self.group = weight, bias, group  # (out, in), (out,)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, prologue: Prologue = None) -> torch.Tensor:
        """x (M, in) -> x W^T + b (M, out), + residual (M, out) last where given (the decoder's skip);
        prologue: x is that row pass's input (applied first, layers.apply_prologue)."""
        x = apply_prologue(prologue, x)
        if self.group is None:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = self.group.all_reduce_sum(F.linear(x, self.weight))  # float sum: close, not bit-exact
            out = out if self.bias is None else out.add_(self.bias)
        return out if residual is None else out.add_(residual)


def use_triton(kernels: str, x: torch.Tensor) -> bool:
    """The dispatch rule of EngineConfig.kernels: auto = Triton-lang kernels for CUDA tensors."""
    return kernels == "triton" or (kernels == "auto" and x.is_cuda)


class Int8Linear:
    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, settings: ComputeSettings,
                 integers: tuple[torch.Tensor, torch.Tensor] | None = None, glu: bool = False):
        """weight: (out, in) float32 -> integer weight W (in, out) for this CPU's exact route
        (exact_matmul.ExactWeight) and per-output-channel scales (out,), rounded to nearest here;
        or `integers` = (W (out, in) integer-valued, scales (out,)[, correction (out,)]) rounded
        elsewhere (GPTQ, gptq.py), |W| <= int_bound(settings.weight_passes); a correction (the mean
        output error calibration measured: gptq.quantize_layer_by_layer) is added to the bias.

        settings.group: a tp.TPGroup when this rank holds a slice of the input columns (row-parallel).
        The row maxima of weights and activations are then all-reduced with MAX and the exact
        integer partial products with SUM, so the output bits equal the unsplit layer's.

        glu: the weight is gate_proj's and up_proj's stacked (gate first); where the exact route's kernel
        has a SwiGLU epilogue (ExactWeight.fuses_swiglu) __call__(swiglu=True) returns silu(gate) * up."""
        self.group = settings.group
        self.act_passes, self.weight_passes = settings.act_passes, settings.weight_passes
        self.act_bound, self.weight_bound = int_bound(self.act_passes), int_bound(self.weight_passes)
        if integers is not None:
            w_int, self.w_scale = integers[0].float(), integers[1].float()  # (out, in), (out,)
            if len(integers) > 2:  # the bias correction: one float32 addition, here, once
                bias = integers[2] if bias is None else bias + integers[2]
            if w_int.abs().max() > self.weight_bound:
                raise ValueError(f"integer weights beyond {self.weight_bound} for {self.weight_passes} pass(es)")
        else:
            amax = weight.abs().amax(dim=1)  # (out,)
            if self.group is not None:
                self.group.all_reduce_max(amax)
            self.w_scale = symmetric_scale(amax, self.weight_bound).to(torch.float32)  # (out,)
            w_int = round_to_grid(weight, self.w_scale[:, None], self.weight_bound)  # (out, in)
        self.w = ExactWeight(w_int.t().contiguous(), self.act_passes, self.weight_passes,  # (in, out)
                             glu=glu and self.group is None)
        # the CPU kernel's epilogue; kernels='triton' runs the Triton-lang GEMM even on CPU tensors
        self.fuses_swiglu = self.w.fuses_swiglu and settings.kernels != "triton"
        # ... and its rotary epilogue (the VNNI tiles), on an unsplit projection (qkv is column-parallel)
        self.fuses_rotary = self.w.fuses_rotary and settings.kernels != "triton" and self.group is None
        self.bias = bias
        self.kernels = settings.kernels

    def quantize_activations(self, x: torch.Tensor):
        """x: (M, in) float32 -> integers X (M, in) as float32, scales (M, 1)."""
        return quantize_rows(x, self.act_bound, None if self.group is None else self.group.all_reduce_max)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, prologue: Prologue = None,
                 swiglu: bool = False, rotary: Rotary | None = None,
                 split: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (M, in) float32 -> the dequantised exact product (M, out), + residual (M, out) last where
        given: the decoder's skip connection, fused into the CPU kernels' epilogue (one float32
        addition either way, so the same bits as adding it after). prologue: x is the input of that
        row pass (RMSNorm, SwiGLU), run by the CPU kernels' quantiser in its own pass (no float32
        copy of its output; the same bits), else first, as its own pass. swiglu (only where
        fuses_swiglu): -> (M, out / 2), silu(gate) * up in the kernel's epilogue, the bits of
        layers.swiglu on the product. rotary (only where fuses_rotary): the rotary embedding of its
        columns' heads in the kernel's epilogue, the bits of layers.apply_rotary on the product; and
        split (with rotary, a multiple of 64): -> (columns [0, split), columns [split, out)), each in its
        own storage (a qkv projection's queries apart from its keys and values: exact_gemm's split)."""
        if swiglu:
            return self.w.linear(x, self.w_scale, self.bias, prologue=prologue, swiglu=True)
        if rotary is not None:
            if not self.fuses_rotary or use_triton(self.kernels, x):
                raise ValueError("this projection's kernel has no rotary epilogue (fuses_rotary is False)")
            return self.w.linear(x, self.w_scale, self.bias, residual, prologue, rotary=rotary, split=split)
        if split:
            raise ValueError("a split output comes with the rotary epilogue (split without rotary)")
        if self.group is not None or use_triton(self.kernels, x):
            x = apply_prologue(prologue, x)
        if self.group is not None:  # row-parallel: an exact sum of integers below 2^53, then dequantised
            x_int, x_scale = self.quantize_activations(x)  # (M, in), (M, 1) with the all-reduced maxima
            out = dequantize(self.group.all_reduce_sum(self.w.matmul(x_int)), x_scale, self.w_scale, self.bias)
        elif use_triton(self.kernels, x):
            out = self._triton(*self.quantize_activations(x))
        else:
            return self.w.linear(x, self.w_scale, self.bias, residual, prologue)  # (M, out) float32
        return out if residual is None else out.add_(residual)

    def _triton(self, x_int: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The Triton-lang exact GEMM on the int8 passes: pass i of X has scale x_scale * 128^(P-1-i),
        W's first pass w_scale * 128^(Q-1), its second (the kernel's weight residual) w_scale. The
        kernel multiplies the weight residual by X's first pass only; the products of X's later
        passes with it come from a second, raw int32 call (|sum| <= 64 * 64 * K: exact in float32)."""
        from kernels.triton.exact_gemm import int8_gemm

        m, passes = x_int.shape[0], self.act_passes
        x_q = torch.cat(int8_passes(x_int, passes))  # (P * M, in) int8
        x_scales = torch.cat([x_scale * float(PASS_BASE ** (passes - 1 - i)) for i in range(passes)])
        digits = self.w.int8_digits()  # (in, out) int8 each
        if self.weight_passes == 1:
            return int8_gemm(x_q, digits[0], x_scales, self.w_scale, self.bias, passes)
        out = int8_gemm(x_q, digits[0], x_scales, self.w_scale * float(PASS_BASE), self.bias, passes,
                        digits[1], self.w_scale)
        if passes > 1:
            later = int8_gemm(x_q[m:], digits[1]).float()  # ((P - 1) * M, out), raw int32 sums
            for i in range(1, passes):
                out.add_(later[(i - 1) * m : i * m].mul_(x_scales[i * m : (i + 1) * m]).mul_(self.w_scale))
        return out


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, settings: ComputeSettings,
                integers: tuple[torch.Tensor, torch.Tensor] | None = None, glu: bool = False):
    """The linear map of `weight` (out, in) in settings.precision (checked in config.py): fp32, or
    integers -- `integers` (8-bit, GPTQ-rounded: one pass a side) where given, else `weight` rounded
    to nearest with settings' passes (the exact 13-bit scheme by default). glu: gate_proj and up_proj
    stacked, for a kernel with a SwiGLU epilogue where there is one (Int8Linear.fuses_swiglu)."""
    if settings.precision == "fp32":
        return Fp32Linear(weight, bias, settings.group)
    if integers is not None:
        return Int8Linear(None, bias, dataclasses.replace(settings, act_passes=1, weight_passes=1), integers, glu)
    return Int8Linear(weight, bias, settings, glu=glu)
