"""Which projections tolerate 8-bit integers, i.e. where could the default use fewer, cheaper products?

    .venv/bin/python bench/precision_sensitivity.py [--limit 16]

With VNNI an 8-bit x 8-bit product (one pass a side) runs at up to ~4x the rate of the default's
exact 13-bit x 13-bit one, so the question is how much of the model can run in 8 bits while the
default keeps the accuracy envelope (mean |p - p_fp32| <= 0.01, agreement with fp32 >= 0.997).
This study answers it on a slice of the eval (the first `--limit` documents of each file) by
simulation: the int8 engine (smoothed weights, as served) with chosen projections replaced by
fake-quantised fp32 ones -- symmetric per-output-channel weights and per-token activations rounded
half-to-even to the integer grid of quant.py, the product in float32 -- so any mix of bit widths can
be tried without a kernel for it. Rows measured with the real engine (the default and 1+1 passes)
show how close the simulation is. Block rows try an MX-like format: blocks of 32 along K sharing
the row's scale times a power of two (integer-exact, so it would keep Prism's invariants).
Writes bench/results/precision_sensitivity.md.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from workloads import write_result

import prism_backend.model.transformer as transformer
from evals import run_eval
from prism_backend.config import EngineConfig
from prism_backend.model.exact_matmul import int_bound
from prism_backend.paths import DEFAULT_MODEL_DIR

BITS = {8: int_bound(1), 13: int_bound(2)}  # |integer| <= 127 (one pass), 8191 (two passes)
KIND_BY_OUT = {960: "qkv", 576: "o", 3072: "gate_up"}  # SmolLM2's widths; "down" is the one with K = 1536


def fake_quantize(x: torch.Tensor, bits: int | None, block: int | None = None) -> torch.Tensor:
    """x (rows, K) -> its values on the symmetric per-row integer grid of `bits` (None: unchanged).
    With `block`, each block of K shares the row's scale times 2^-e, e >= 0 the largest that still
    covers the block's maximum (a block exponent, as in the MX formats)."""
    if bits is None:
        return x
    bound = BITS[bits]
    x64 = x.double()
    amax = x64.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / bound, torch.ones_like(amax))  # (rows, 1)
    if block is None:
        return (x64 / scale).round().clamp(-bound, bound).mul(scale).float()
    k = x.shape[1]
    blocks = F.pad(x64, (0, -k % block)).view(x.shape[0], -1, block)  # (rows, K / block, block)
    block_max = blocks.abs().amax(dim=2, keepdim=True).clamp_min(1e-300)
    exponent = torch.floor(torch.log2(amax[:, :, None] / block_max)).clamp(0, 30)
    block_scale = scale[:, :, None] * torch.pow(2.0, -exponent)
    q = (blocks / block_scale).round().clamp(-bound, bound) * block_scale
    return q.view(x.shape[0], -1)[:, :k].float()


class SimulatedLinear:
    """An fp32 projection whose weight (out, in) and activations are fake-quantised."""

    def __init__(self, weight, bias, weight_bits, act_bits, block=None):
        self.weight = fake_quantize(weight, weight_bits, block)
        self.bias, self.act_bits, self.block = bias, act_bits, block

    def __call__(self, x):
        return F.linear(fake_quantize(x, self.act_bits, self.block), self.weight, self.bias)


def projection_kind(weight: torch.Tensor) -> str:
    return "down" if weight.shape[1] == 1536 else KIND_BY_OUT.get(weight.shape[0], "qkv")  # q / kv: last layer


def simulate(config: EngineConfig, docs, choose):
    """Decisions of the int8 engine whose projection i (in construction order: per layer qkv, o,
    gate_up, down) of `kind` in layer `layer` gets choose(kind, layer) = (weight bits, act bits, block)."""
    real, layer = transformer.make_linear, [0]

    def make(weight, bias, settings):
        kind = projection_kind(weight)
        linear = SimulatedLinear(weight, bias, *choose(kind, layer[0]))
        layer[0] += kind == "down"
        return linear

    transformer.make_linear = make
    try:
        return run_eval.run_engine(config, docs)
    finally:
        transformer.make_linear = real


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=16, help="documents per eval file")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    args = parser.parse_args()
    docs = run_eval.load(args.limit)
    int8 = EngineConfig(model_dir=args.model_dir, precision="exact", prefix_cache_bytes=0)
    reference = run_eval.run_engine(int8.replace(precision="fp32"), docs)

    def probabilities(decisions):
        return np.array([p for d in decisions for p in d["probabilities"].values()])

    def picks(decisions):
        return [max(d["probabilities"], key=d["probabilities"].get) for d in decisions]

    p_fp32, k_fp32 = probabilities(reference), picks(reference)
    rows = []

    def row(name, decisions):
        diff = np.abs(probabilities(decisions) - p_fp32)
        agree = np.mean([a == b for a, b in zip(picks(decisions), k_fp32)])
        rows.append(f"| {name} | {agree:.4f} | {diff.mean():.5f} | {diff.max():.4f} |")
        print(rows[-1], flush=True)

    row("engine: default (13 x 13 bits, 2+2 passes)", run_eval.run_engine(int8, docs))
    row("engine: 8 x 8 bits (1+1 passes)", run_eval.run_engine(int8.replace(act_passes=1, weight_passes=1), docs))
    uniform = {
        "simulated: 13 x 13 bits everywhere (the default)": (13, 13, None),
        "simulated: 8 x 8 bits everywhere": (8, 8, None),
        "simulated: 8-bit weights, fp32 activations": (8, None, None),
        "simulated: fp32 weights, 8-bit activations": (None, 8, None),
        "simulated: 8-bit weights in blocks of 32 (power-of-two exponents), fp32 activations": (8, None, 32),
        "simulated: 8 x 8 bits in blocks of 32 (power-of-two exponents) both sides": (8, 8, 32),
    }
    for name, scheme in uniform.items():
        row(name, simulate(int8, docs, lambda kind, layer, scheme=scheme: scheme))
    for only in ("qkv", "o", "gate_up", "down"):
        row(f"simulated: 8 x 8 bits on {only} only, 13 x 13 elsewhere",
            simulate(int8, docs, lambda kind, layer, only=only: (8, 8, None) if kind == only else (13, 13, None)))
    for only in (0, 10, 20, 29):
        row(f"simulated: 8 x 8 bits in layer {only} only, 13 x 13 elsewhere",
            simulate(int8, docs, lambda kind, layer, only=only: (8, 8, None) if layer == only else (13, 13, None)))
    lines = ["# Precision sensitivity: which projections tolerate 8 bits", "",
             f"`.venv/bin/python bench/precision_sensitivity.py --limit {args.limit}`: the first {args.limit} "
             f"documents of each eval file ({len(reference)} decisions); every row against the fp32 engine. "
             "'engine' rows are the real int8 engine; 'simulated' rows fake-quantise the chosen projections "
             "of the same smoothed int8 model (see the script). The default's envelope: agreement >= 0.997, "
             "mean |dp| <= 0.01.", "",
             "| scheme | agreement with fp32 | mean abs(p - p_fp32) | max abs(p - p_fp32) |", "|---|---|---|---|",
             *rows]
    write_result("precision_sensitivity.md", lines)


if __name__ == "__main__":
    main()
