"""Where one forward's milliseconds go, on workloads (a) and (b), for each precision asked for.

    .venv/bin/python bench/forward_profile.py [--precision int8 exact fp32 int8:float] [--repeats 5]
                                              [--keep-exact 'qkv,down:1+2']

A precision may name tree attention's arithmetic after a colon (EngineConfig.attention): `int8:float`
is the int8 default with float32 attention instead of its integer form.

Each step of the decoder (prism_backend/model/transformer.py) is wrapped with a wall-clock timer:
every projection by name (its quantisation, integer product and epilogue included: the kernels fuse
them; so is the row pass in front of it, which its quantiser runs in the same pass where the kernel
library has the fused form: RMSNorm for qkv and gate_up, SwiGLU with the online Hadamard for down --
or, where gate_up's kernel ends in SwiGLU (the 8-bit tile, VNNI or AMX), SwiGLU in gate_up and the Hadamard
in down),
attention, the rotary embedding, the RMSNorms left (the last layer's and the final one), the K/V
concatenation; "forest, scoring, rest" is the time of `decide_many` outside the decoder's steps
(tokenising, the forest, the embedding lookup, the residual adds, candidate scoring, Python). The
steps run synchronously on the CPU, so their times add up to the forward's. 2 threads, prefix cache
off, one warm-up, then the median of `--repeats` runs per step. "outside the kernel library" is the
forward's time outside every call into kernels/cpu's library (GEMMs, quantisers, attention, row
passes): the Python pipeline between the kernels, torch's copies and allocation, tokenising -- the
serial part, which the other thread waits through. The steps are timed on the Python pipeline's
layers (the projections wrapped in timers run one by one); where the layers run in one library call
(kernels/cpu/decoder_layer.py: the VNNI kernels), the rows "served forward" and "served: outside the
kernel library" give the forward as served, measured first, before any projection is wrapped.
Writes bench/results/forward_profile.md.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections import defaultdict

import torch
from workloads import WORKLOADS, write_result

import prism_backend.model.transformer as transformer
from kernels.cpu import exact_gemm
from kernels.cpu.features import machine
from prism_backend.config import EngineConfig
from prism_backend.model.exact_matmul import describe_chosen_routes
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH
from prism_backend.serving.pipeline import DecisionPipeline

PROJECTIONS = ("qkv", "q", "kv", "o", "gate_up", "down")
# module-level functions of transformer.py (RMSNorm and SwiGLU run inside the projections after them)
STEPS = ("rms_norm", "apply_rotary", "_extend")
totals: dict[str, float] = defaultdict(float)  # step -> seconds in the current run
LIBRARY = "kernel library calls"  # timed apart from the steps (they overlap them), not a row itself
OUTSIDE = "outside the kernel library"
SERVED, SERVED_OUTSIDE = "served forward", "served: outside the kernel library"


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    wrapper.fuses_swiglu = getattr(fn, "fuses_swiglu", False)  # the decoder asks gate_up (transformer.py)
    wrapper.fuses_rotary = getattr(fn, "fuses_rotary", False)  # ... and qkv
    return wrapper


def instrument(pipeline: DecisionPipeline) -> None:
    """Wrap this pipeline's projections and attention, and transformer.py's step functions."""
    for p in pipeline.engine.model.proj:
        for name in PROJECTIONS:
            if getattr(p, name) is not None:
                setattr(p, name, timed(f"projection {name}", getattr(p, name)))


def instrument_module() -> None:
    for name in STEPS:
        setattr(transformer, name, timed(name.strip("_"), getattr(transformer, name)))
    attention = transformer.ForestAttention
    attention.rows = timed("attention", attention.rows)
    attention.answers = timed("attention", attention.answers)


def instrument_library() -> bool:
    """Wrap every library function the forwards have called so far (ctypes keeps them in the library
    object's __dict__ once looked up; call after a warm-up) -> whether the library is loaded here."""
    lib = exact_gemm.load()
    if lib is None:
        return False
    for name, fn in list(vars(lib).items()):
        if name.startswith("prism_") and isinstance(fn, ctypes._CFuncPtr):
            setattr(lib, name, timed(LIBRARY, fn))
    return True


def profile(pipeline: DecisionPipeline, requests, repeats: int) -> dict[str, float]:
    """step -> median ms over `repeats` runs (after a warm-up), 'total', and OUTSIDE where the kernel
    library runs here."""
    pipeline.decide_many(requests)
    library = instrument_library()
    runs = []
    for _ in range(repeats):
        totals.clear()
        start = time.perf_counter()
        pipeline.decide_many(requests)
        run = dict(totals)
        run["total"] = time.perf_counter() - start
        inside = run.pop(LIBRARY, 0.0)
        if library:
            run[OUTSIDE] = run["total"] - inside
        runs.append(run)
    steps = {k for run in runs for k in run}
    ms = {k: 1000 * statistics.median(run.get(k, 0.0) for run in runs) for k in steps}
    ms["forest, scoring, rest"] = ms["total"] - sum(v for k, v in ms.items() if k not in ("total", OUTSIDE))
    return ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", nargs="+", default=["int8", "exact", "fp32"],
                        help="precision[:attention] (EngineConfig.attention: integer, float)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep-exact", default=EngineConfig.keep_exact, help="int8's precision plan (EngineConfig)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    instrument_module()
    results = {}
    for precision in args.precision:
        name, _, attention = precision.partition(":")
        config = EngineConfig(model_dir=DEFAULT_MODEL_DIR, precision=name, attention=attention or "auto",
                              keep_exact=args.keep_exact, prefix_cache_bytes=0, num_threads=2)
        pipeline = DecisionPipeline(config, REGISTRY_PATH)
        model = pipeline.engine.model
        served = {}
        if any(model._one_call_layer(i) for i in range(len(model.proj))):  # the forward as served, first
            for workload, make in WORKLOADS.items():
                run = profile(pipeline, make(), args.repeats)
                served[workload] = {SERVED: run["total"], **({SERVED_OUTSIDE: run[OUTSIDE]} if OUTSIDE in run else {})}
        instrument(pipeline)  # every projection in a timer: the layers run step by step
        for workload, make in WORKLOADS.items():
            results[(precision, workload)] = {**profile(pipeline, make(), args.repeats), **served.get(workload, {})}
        pipeline.engine.close()
    columns = list(results)
    extra = [k for k in (OUTSIDE, SERVED, SERVED_OUTSIDE) if any(k in r for r in results.values())]
    steps = sorted({k for r in results.values() for k in r} - {"total", *extra},
                   key=lambda k: -max(r.get(k, 0.0) for r in results.values()))
    routes = describe_chosen_routes() or "none"
    plan = "" if args.keep_exact == EngineConfig.keep_exact else f" --keep-exact '{args.keep_exact}'"
    which = "the default plan" if not plan else "the plan"
    lines = ["# Where one forward's time goes", "",
             f"`.venv/bin/python bench/forward_profile.py --precision {' '.join(args.precision)} --repeats "
             f"{args.repeats}{plan}`, {time.strftime('%Y-%m-%d')}, on {machine()}, 2 threads, prefix cache off; ms, median "
             f"of {args.repeats} runs per step (int8 is {which}, keep_exact={args.keep_exact!r}). Exact-product routes "
             f"chosen (passes, K x N): {routes}.", "",
             "| step | " + " | ".join(f"{p} {w.split(':')[0]}" for p, w in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for step in steps + ["total"] + extra:
        cells = []
        for column in columns:
            if step in extra and step not in results[column]:  # no layer in one call (fp32), or no library
                cells.append("-")
                continue
            value, total = results[column].get(step, 0.0), results[column][SERVED if step == SERVED_OUTSIDE else "total"]
            cells.append(f"{value:.0f}" + ("" if step == "total" else f" ({100 * value / total:.0f}%)"))
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    write_result("forward_profile.md", lines)


if __name__ == "__main__":
    main()
