"""The decoder forward over a packed forest, returning only the answer positions' hidden states.

`run` computes a contiguous range of the forest's segments given the K/V of the rows before it
(from the prefix cache, or from earlier prefill chunks) and returns the K/V up to its end, so the
engine can compute a forest in one pass or in chunks with the same per-segment computations.

Where every projection of a layer runs on the kernel library's VNNI kernels and attention on its
tree attention, the layer runs in one call into the library (kernels/cpu/decoder_layer.py: the same
kernels in the same order, so the same bits, without the interpreter between them); elsewhere (other
kernels, TP, the GPU, calibration's wrapped projections) the steps below run one by one.

Work that no answer needs is skipped: the last layer computes keys and values for every row (the
answer rows attend to them) but queries, attention output, MLP and the final norm only for the
answer rows; no LM head runs here at all (scoring.py multiplies by the candidate rows only).
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import ComputeSettings
from ..forest import Forest
from .attention import ForestAttention
from kernels.cpu import decoder_layer
from kernels.cpu.prologues import ROTARY_HEAD, Hadamard, RmsNorm, Rotary, SwiGLU

from .layers import RotaryTable, apply_rotary, library_runs_prologue, rms_norm
from .loader import LayerWeights, ModelWeights
from .spec import ModelSpec
from .quant import Int8Linear, make_linear


class Projections:
    """The linear maps of one layer in the chosen precision. The last layer needs q (answer rows
    only) apart from k/v (all rows), so it holds the row blocks `q` and `kv` instead of `qkv`;
    quantised per output channel, they give the same bits as slicing qkv's output would."""

    def __init__(self, lw: LayerWeights, spec: ModelSpec, settings: ComputeSettings, last: bool):
        unsplit = settings.with_group(None)  # column-parallel maps need no collective

        integers, passes = lw.integers or {}, lw.passes or {}

        def make(weight, bias=None, row_parallel=False, name=None, glu=False):
            chosen = settings if row_parallel else unsplit
            own = passes.get("qkv" if name in ("q", "kv") else name)  # the plan's passes for a projection it keeps
            if own is not None:
                chosen = dataclasses.replace(chosen, act_passes=own[0], weight_passes=own[1])
            return make_linear(weight, bias, chosen, integers.get(name), glu)

        self.qkv = self.q = self.kv = None
        if last:
            sizes = [spec.q_dim, 2 * spec.kv_dim]
            w_q, w_kv = lw.wqkv.split(sizes) if lw.wqkv is not None else (None, None)  # None: from integers
            b_q, b_kv = lw.bqkv.split(sizes) if lw.bqkv is not None else (None, None)
            if "qkv" in integers:  # rows of per-output-channel integers (scales, correction) split like the weight
                q_part, kv_part = zip(*(t.split(sizes) for t in integers["qkv"]))
                integers = {**integers, "q": q_part, "kv": kv_part}
            self.q, self.kv = make(w_q, b_q, name="q"), make(w_kv, b_kv, name="kv")
        else:
            self.qkv = make(lw.wqkv, lw.bqkv, name="qkv")
        self.o = make(lw.wo, row_parallel=True, name="o")  # with TP: this rank's heads -> partial sums
        self.gate_up = make(lw.w_gate_up, name="gate_up", glu=True)  # SwiGLU in its epilogue where a kernel has it
        self.down = make(lw.w_down, row_parallel=True, name="down")  # with TP: this rank's MLP columns


class ForestTransformer:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, settings: ComputeSettings = ComputeSettings(),
                 every_row: bool = False):
        """spec: the shapes this rank computes (tp.local_spec); settings: precision, int8 passes,
        kernels and this rank's TP group (None unsplit); the default is the plain fp32 model.
        every_row: compute the last layer for every row like the others (calibration: GPTQ needs
        the last layer's inputs on every row, not only the answers')."""
        self.spec = spec
        self.w = weights
        self.kernels = settings.kernels
        self.integer_attention = settings.integer_attention
        self.every_row = every_row
        last = -1 if every_row else len(weights.layers) - 1
        self.proj = [Projections(lw, spec, settings, i == last) for i, lw in enumerate(weights.layers)]
        self.rotary = RotaryTable(weights.inv_freq, weights.rope_scaling, spec.max_context)
        self.one_call_layers = True  # run layers in one library call where they can (bench/forward_profile.py: off)
        self._one_call: dict[int, tuple[tuple, decoder_layer.DecoderLayer | None]] = {}
        if settings.precision != "fp32":  # the projections hold their own quantised copies
            for lw in weights.layers:
                lw.wqkv = lw.bqkv = lw.wo = lw.w_gate_up = lw.w_down = lw.integers = None

    def _qk_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.spec.rms_norm_eps)

    def _mlp_block(self, h: torch.Tensor, lw: LayerWeights, p: Projections) -> torch.Tensor:
        """h + down(swiglu(gate_up(rms_norm(h)))) -- in a rotated model swiglu times down_proj's online
        Hadamard (rotation.online_down). Each row pass is given to the projection after it, whose kernel
        runs it in its quantiser's pass (kernels/cpu/prologues.py), or SwiGLU ends gate_up's own kernel
        where it can (the 8-bit tile's epilogue, VNNI or AMX); the residual is added in down's epilogue."""
        norm, block = RmsNorm(lw.post_norm, self.spec.rms_norm_eps), self.w.down_block or 0
        if getattr(p.gate_up, "fuses_swiglu", False):  # (calibration's wrappers have no such kernel)
            activated = p.gate_up(h, prologue=norm, swiglu=True)  # (n, I)
            return p.down(activated, residual=h, prologue=Hadamard(block) if block else None)
        gate_up = p.gate_up(h, prologue=norm)  # (n, 2 I)
        return p.down(gate_up, residual=h, prologue=SwiGLU(block))

    def _rotary_in_qkv(self, lw: LayerWeights, p: Projections) -> bool:
        """Whether qkv's kernel applies the rotary embedding in its epilogue (the VNNI tiles: heads of
        64 columns), which it can only where no norm of q or k (Qwen3's) comes between the two."""
        return getattr(p.qkv, "fuses_rotary", False) and lw.q_norm is None and lw.k_norm is None and \
            self.spec.head_dim == ROTARY_HEAD

    def _one_call_layer(self, i: int) -> decoder_layer.DecoderLayer | None:
        """Layer i's weights for the one-call layer, or None where one of its steps runs elsewhere. Kept
        while its projections are the same objects (calibration and the benches swap them for wrappers)."""
        lw, p = self.w.layers[i], self.proj[i]
        key = (p.qkv, p.o, p.gate_up, p.down)
        cached = self._one_call.get(i)
        if cached is not None and all(a is b for a, b in zip(cached[0], key)):
            return cached[1]
        block = self.w.down_block or 0
        eligible = p.qkv is not None and all(
            type(x) is Int8Linear and x.group is None and x.kernels != "triton" and x.w.fused is not None and
            decoder_layer.runs_in_one_call(x.w.fused) for x in key) and self._rotary_in_qkv(lw, p) and \
            library_runs_prologue(Hadamard(block)) and lw.input_norm.device.type == "cpu"
        layer = None
        if eligible:
            qkv, o, gate_up, down = (decoder_layer.Projection(x.w.fused, x.w.x_bound, x.w_scale, x.bias) for x in key)
            layer = decoder_layer.DecoderLayer(qkv, o, gate_up, down, lw.input_norm, lw.post_norm, self.spec.rms_norm_eps,
                                               self.spec.num_heads, self.spec.num_kv_heads, block)
        self._one_call[i] = (key, layer)
        return layer

    def _layer(self, h, lw: LayerWeights, p: Projections, attention: ForestAttention, cos, sin, past):
        """h: (n, H) rows being computed; past: K/V of the rows before them or None -> (h, k, v)."""
        s = self.spec
        norm = RmsNorm(lw.input_norm, s.rms_norm_eps)
        fused = self._rotary_in_qkv(lw, p)
        # k and v in storage of their own, not views of the whole (n, q_dim + 2 kv_dim) output: run()
        # holds every layer's K/V, and views would keep each layer's queries alive with them -- at
        # 1,866 rows 7 MB a layer, 200 MB of a replica's resident memory for nothing
        if fused:  # q and k come out rotated (the bits of apply_rotary after the product), and k and v
            # in their own (n, 2 kv_dim) tensor (the kernel's split output), which attention reads in place
            q, kv = p.qkv(h, prologue=norm, rotary=Rotary(cos[:, 0], sin[:, 0], s.q_dim + s.kv_dim), split=s.q_dim)
            k, v = (t.reshape(-1, s.num_kv_heads, s.head_dim) for t in kv.split([s.kv_dim, s.kv_dim], dim=-1))
            q = q.reshape(-1, s.num_heads, s.head_dim)
        else:
            qkv = p.qkv(h, prologue=norm)  # (n, q_dim + 2 kv_dim) of rms_norm(h)
            q, k, v = qkv.split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
            q = self._qk_norm(q.reshape(-1, s.num_heads, s.head_dim), lw.q_norm)  # (read in place by attention)
            k = self._qk_norm(k.reshape(-1, s.num_kv_heads, s.head_dim), lw.k_norm)
            v = v.reshape(-1, s.num_kv_heads, s.head_dim).contiguous()
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = _extend(past, k, v)  # (rows so far, Hkv, D)
        attn = attention.rows(q, k, v)  # (n, Hq, D)
        h = p.o(attn.reshape(-1, s.q_dim), residual=h)  # h + o(attn)
        return self._mlp_block(h, lw, p), k, v

    def _last_layer(self, h, lw: LayerWeights, p: Projections, attention: ForestAttention, answers, cos, sin, past):
        """Keys/values for every computed row, everything else for the answer rows only -> (A, H)."""
        s = self.spec
        x = rms_norm(h, lw.input_norm, s.rms_norm_eps)
        k, v = p.kv(x).split([s.kv_dim, s.kv_dim], dim=-1)
        k = self._qk_norm(k.reshape(-1, s.num_kv_heads, s.head_dim), lw.k_norm)
        v = v.reshape(-1, s.num_kv_heads, s.head_dim).contiguous()  # not a view of kv's output (_layer)
        k, v = _extend(past, apply_rotary(k, cos, sin), v)
        if answers.numel() == 0:  # a prefill chunk without questions: only its K/V is needed
            return h[:0], k, v
        q = p.q(x[answers])
        q = self._qk_norm(q.reshape(-1, s.num_heads, s.head_dim), lw.q_norm)
        q = apply_rotary(q, cos[answers], sin[answers])
        attn = attention.answers(q, k, v)  # (A, Hq, D)
        h = p.o(attn.reshape(-1, s.q_dim), residual=h[answers])
        return self._mlp_block(h, lw, p), k, v

    @torch.inference_mode()
    def run(self, forest: Forest, computed: list[int], past: list | None = None, keep_kv: bool = True):
        """Compute the segments `computed` (contiguous rows [a, b), parents before children) given
        `past`, the K/V of rows [0, a) per layer ((a, Hkv, D) pairs; None when a = 0).

        Returns (final-normed hidden states of the answer rows of the branches among `computed`,
        (A, H), in segment order; K/V of rows [0, b) per layer, or None without keep_kv: then each
        layer's K/V is freed as the next layer starts instead of held to the end).
        """
        h, attention, answers, cos, sin = self._begin(forest, computed)
        kv = [] if keep_kv else None
        full = len(self.w.layers) if self.every_row else len(self.w.layers) - 1
        layers = [self._one_call_layer(i) if self.one_call_layers and attention.cpu_tables is not None else None
                  for i in range(full)]
        one_call = None  # the operands the one-call layers share in this pass
        if any(layers) and h.shape[0]:
            keys = h.shape[0] + (past[0][0].shape[0] if past else 0)
            one_call = decoder_layer.LayerForward([x for x in layers if x], h.shape[0], keys, cos[:, 0], sin[:, 0],
                                                  *attention.cpu_tables[0], attention.integer)
        for i, (lw, p) in enumerate(zip(self.w.layers[:full], self.proj[:full])):
            if layers[i] is not None and one_call is not None:
                h, k, v = layers[i](one_call, h, past[i] if past else None)
            else:
                h, k, v = self._layer(h, lw, p, attention, cos, sin, past[i] if past else None)
            if keep_kv:
                kv.append((k, v))
        if self.every_row:
            return rms_norm(h, self.w.final_norm, self.spec.rms_norm_eps), kv
        h, k, v = self._last_layer(h, self.w.layers[-1], self.proj[-1], attention, answers, cos, sin,
                                   past[-1] if past else None)
        if keep_kv:
            kv.append((k, v))
        return rms_norm(h, self.w.final_norm, self.spec.rms_norm_eps), kv

    def _begin(self, forest: Forest, computed: list[int]):
        """What a pass over the segments `computed` starts from: (their rows' embeddings (n, H), the
        attention over them, the answer rows (A,) within them, rotary cos and sin (n, D))."""
        segs = forest.segments
        a = segs[computed[0]].start
        b = segs[computed[-1]].start + segs[computed[-1]].length
        branches = [i for i in computed if segs[i].is_branch]
        answers = torch.tensor([segs[i].start + segs[i].length - 1 - a for i in branches], dtype=torch.long)
        attention = ForestAttention(segs, computed, branches, self.kernels, self.w.embed.device, self.spec.head_dim,
                                    self.integer_attention)
        cos, sin = self.rotary(forest.positions[a:b])
        return self.w.embed[forest.token_ids[a:b]], attention, answers, cos, sin

    @torch.inference_mode()
    def layer_by_layer(self, forests: list[Forest]):
        """Calibration (every_row): every row of every forest, one layer at a time across all of them
        -- yields layer i's index once each forest has gone through it, so the caller can use what
        layer i's projections saw over all the forests before layer i + 1 runs. Each forest's rows
        get the computations answer_hidden gives them (nothing cached, no final norm), and each
        projection sees the forests in their order, as a loop of answer_hidden calls shows them."""
        assert self.every_row, "layer_by_layer computes every row of every layer"
        states = [list(self._begin(forest, list(range(len(forest.segments))))) for forest in forests]
        for i, (lw, p) in enumerate(zip(self.w.layers, self.proj)):
            for state in states:
                h, attention, _, cos, sin = state
                state[0], _, _ = self._layer(h, lw, p, attention, cos, sin, None)
            yield i

    def answer_hidden(self, forest: Forest) -> torch.Tensor:
        """The whole forest in one pass, nothing cached: final-normed answer states (A, H)."""
        hidden, _ = self.run(forest, list(range(len(forest.segments))), keep_kv=False)
        return hidden


def _extend(past, k: torch.Tensor, v: torch.Tensor):
    return (k, v) if past is None else (torch.cat([past[0], k]), torch.cat([past[1], v]))
