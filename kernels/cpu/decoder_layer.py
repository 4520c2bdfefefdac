"""A decoder layer in one call into the kernel library (csrc/decoder_layer.cpp): RMSNorm + quantise ->
qkv with the rotary epilogue and its split output -> tree attention reading k, v in place -> quantise
-> o + residual -> RMSNorm + quantise -> gate_up (ending in SwiGLU where its 8-bit tile does) ->
SwiGLU or the online Hadamard + quantise -> down + residual. The kernels, operands and order of the
Python pipeline (prism_backend/model/transformer.py), so the same bits (tests/test_decoder_layer_cpu.py),
without the interpreter between the kernels: there it spent ~0.6 ms a layer on 2 cores while the
other core waited.

Every projection must run on a VNNI kernel of this library (PackedWeight with vnni: 13-16-bit
integers; PackedWeight8 without AMX: 8 bits), unsplit; DecoderLayer.__init__ checks the shapes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.exact_gemm import (PackedWeight, PackedWeight8, _library, chunk_pairs, hadamard_block_fits,
                                    has_avx512_vnni, wide_lanes)
from kernels.cpu.tree_attention import HEAD_DIM

_int, _ptr = ctypes.c_int, ctypes.c_void_p


class _Projection(ctypes.Structure):  # csrc/decoder_layer.cpp Projection
    _fields_ = [("bits", _int), ("k", _int), ("groups", _int), ("n", _int), ("block", _int), ("x_bound", _int),
                ("packed", _ptr), ("aux", _ptr), ("w_scale", _ptr), ("bias", _ptr)]


class _Layer(ctypes.Structure):  # PrismLayer
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection),
                ("input_norm", _ptr), ("post_norm", _ptr), ("eps", ctypes.c_float),
                ("hidden", _int), ("q_dim", _int), ("kv_dim", _int), ("heads", _int), ("kv_heads", _int),
                ("intermediate", _int), ("swiglu_in_gate_up", _int), ("down_block", _int)]


class _Forward(ctypes.Structure):  # PrismForward
    _fields_ = [("m", _int), ("keys", _int), ("cos", _ptr), ("sin", _ptr), ("key_rows", _ptr), ("segments", _ptr),
                ("count", _int), ("attention_wide", _int), ("integer", _int), ("quantizer_wide", _int),
                ("threads", _int), ("operand", _ptr), ("scale", _ptr), ("q", _ptr), ("attn", _ptr), ("h_mid", _ptr),
                ("act", _ptr)]


@dataclass(frozen=True)
class Projection:
    """One served projection as the layer takes it: its packed weight, the activations' integer bound,
    per-output-channel scales (N,) and bias (N,) or None, in W's column order (Int8Linear's)."""

    packed: PackedWeight | PackedWeight8
    x_bound: int
    w_scale: torch.Tensor
    bias: torch.Tensor | None


def runs_in_one_call(packed) -> bool:
    """Whether a packed weight has a kernel the one-call layer runs (the VNNI ones)."""
    return (isinstance(packed, PackedWeight) and packed.vnni) or (isinstance(packed, PackedWeight8) and not packed.amx)


class DecoderLayer:
    """One layer's weights for prism_decoder_layer, built once (the pointers stay valid: the tensors
    are held here)."""

    def __init__(self, qkv: Projection, o: Projection, gate_up: Projection, down: Projection,
                 input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
                 down_block: int = 0):
        """heads, kv_heads: of HEAD_DIM each; down_block: down_proj's online Hadamard block (a power of
        two dividing the MLP's width; 0 for none). gate_up ends in SwiGLU where its weight is packed with
        glu (PackedWeight8(glu=True)), else down's quantiser runs SwiGLU."""
        q_dim, kv_dim, hidden = heads * HEAD_DIM, kv_heads * HEAD_DIM, input_norm.numel()
        glu = isinstance(gate_up.packed, PackedWeight8) and gate_up.packed.order is not None
        intermediate = gate_up.packed.n // 2
        shapes = {"qkv": (qkv, hidden, q_dim + 2 * kv_dim), "o": (o, q_dim, hidden),
                  "gate_up": (gate_up, hidden, 2 * intermediate), "down": (down, intermediate, hidden)}
        for name, (p, k, n) in shapes.items():
            if not runs_in_one_call(p.packed) or (p.packed.k, p.packed.n) != (k, n):
                raise ValueError(f"{name}: a VNNI kernel's ({k}, {n}) weight is what the one-call layer takes, got "
                                 f"{type(p.packed).__name__} ({p.packed.k}, {p.packed.n})")
            if name != "gate_up" and isinstance(p.packed, PackedWeight8) and p.packed.order is not None:
                raise ValueError(f"{name}: only gate_up's weight may be packed with glu")
        if not hadamard_block_fits(down_block, intermediate):
            raise ValueError(f"down's Hadamard block must be 0 or a power of two dividing {intermediate}, got {down_block}")
        self.hidden, self.q_dim, self.kv_dim, self.kv_heads = hidden, q_dim, kv_dim, kv_heads
        self.act_columns = intermediate if glu else 2 * intermediate
        # the widest operand row of the four projections, in bytes (uint8 4 * kquads, int16 2 * kpairs)
        self.operand_bytes = max(4 * p.packed.kquads if isinstance(p.packed, PackedWeight8) else 4 * p.packed.kpairs
                                 for p, _, _ in shapes.values())
        self._keep: list[torch.Tensor] = []
        self.args = _Layer(self._projection(qkv), self._projection(o), self._projection(gate_up),
                           self._projection(down), self._pointer(input_norm), self._pointer(post_norm), eps, hidden,
                           q_dim, kv_dim, heads, kv_heads, intermediate, int(glu), down_block)

    def _pointer(self, t: torch.Tensor | None):
        if t is None:
            return None
        t = t.float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _projection(self, p: Projection) -> _Projection:
        packed, w_scale, bias = p.packed, p.w_scale.reshape(-1), p.bias
        if isinstance(packed, PackedWeight8):
            if packed.order is not None:  # scales and bias in the glu panels' column order (PackedWeight8.matmul)
                w_scale, bias = w_scale[packed.order], None if bias is None else bias[packed.order]
            return _Projection(8, packed.k, packed.kquads, packed.n, 0, p.x_bound, packed.packed.data_ptr(),
                               packed.correction.data_ptr(), self._pointer(w_scale), self._pointer(bias))
        return _Projection(16, packed.k, packed.kpairs, packed.n, chunk_pairs(p.x_bound, packed.w_bound), p.x_bound,
                           packed.packed.data_ptr(), packed.row_max.data_ptr(), self._pointer(w_scale),
                           self._pointer(bias))

    def __call__(self, forward: LayerForward, h: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None):
        """h: (m, hidden) float32 contiguous; past: the K/V of the rows before them ((a, kv_heads, 64)
        each) or None -> (the layer's output (m, hidden), k and v of every row so far, (a + m, kv_heads,
        64) each: views of one (a + m, 2 kv_dim) tensor, attention's and the next chunk's)."""
        m, keys = forward.args.m, forward.args.keys
        if h.shape != (m, self.hidden) or not h.is_contiguous() or h.dtype != torch.float32:
            raise ValueError(f"the layer takes h as contiguous float32 ({m}, {self.hidden}), got {tuple(h.shape)}")
        kv = torch.empty(keys, 2 * self.kv_dim)
        a = keys - m
        if a:
            if past is None or past[0].shape[0] != a:
                raise ValueError(f"the layer needs the K/V of the {a} rows before its {m}")
            kv[:a, : self.kv_dim] = past[0].reshape(a, self.kv_dim)
            kv[:a, self.kv_dim :] = past[1].reshape(a, self.kv_dim)
        h_out = torch.empty(m, self.hidden)
        _library().prism_decoder_layer(ctypes.byref(self.args), ctypes.byref(forward.args), h.data_ptr(), kv.data_ptr(),
                                h_out.data_ptr())
        k, v = (t.reshape(keys, self.kv_heads, HEAD_DIM) for t in kv.split(self.kv_dim, dim=1))
        return h_out, k, v


class LayerForward:
    """One forward's (or prefill chunk's) operands for every DecoderLayer of it: m computed rows after
    a = keys - m rows of K/V, their rotary table rows cos, sin (m, 64) float32 contiguous, tree
    attention's tables (tree_attention.segment_table's) and form, and the scratch the layers share."""

    def __init__(self, layers: list[DecoderLayer], m: int, keys: int, cos: torch.Tensor, sin: torch.Tensor,
                 key_rows: torch.Tensor, table: torch.Tensor, integer: bool):
        if cos.shape != (m, HEAD_DIM) or sin.shape != (m, HEAD_DIM) or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"cos and sin must be contiguous ({m}, {HEAD_DIM}), got {tuple(cos.shape)}")
        attention_wide = wide_lanes(has_avx512_vnni() if integer else None, "tree attention")
        first = layers[0]
        self._keep = [cos.float(), sin.float(), key_rows, table,
                      torch.empty(m * max(layer.operand_bytes for layer in layers), dtype=torch.uint8),
                      torch.empty(m), torch.empty(m, first.q_dim), torch.empty(m, first.q_dim), torch.empty(m, first.hidden),
                      torch.empty(m, max(layer.act_columns for layer in layers))]
        pointers = [t.data_ptr() for t in self._keep]
        self.args = _Forward(m, keys, pointers[0], pointers[1], pointers[2], pointers[3], table.shape[0],
                             int(attention_wide), int(integer), int(wide_lanes(None, "the row quantiser")),
                             torch.get_num_threads(), *pointers[4:])
