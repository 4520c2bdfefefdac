"""Times vLLM (CPU build) on prompts given as token ids; runs inside the vLLM virtualenv.

    .venv-vllm/bin/python bench/vllm_driver.py IN.json OUT.json

IN:  {"model_dir": str, "prefix_caching": bool, "dtype": "bfloat16",
      "calls": [[{"prompt_ids": [int], "candidate_ids": [int]}, ...], ...]}
     Each call is one `LLM.generate` with its prompts submitted together (what a batch of
     concurrent requests is to vLLM); calls run one after another, in order.
OUT: {"seconds": [per call], "probabilities": [[per prompt, renormalised over its candidates]],
      "rss_bytes": resident memory of vLLM's processes after the run, "startup_seconds": float}

Probabilities come from `logprob_token_ids` (full-vocabulary log-probabilities of exactly the
candidate ids), renormalised over the candidates as Prism's are. Settings: vLLM's OpenMP
threads bound to every core this process may use (VLLM_CPU_OMP_THREADS_BIND), a 2 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE), block size 32 so that prefix caching can reuse all but < 32 tokens,
eager mode.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from driver_io import DriverSession, driver_calls, run_driver

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32"}  # vLLM's --dtype -> the name results use


def fastest_dtype() -> str:
    """vLLM's fastest dtype on this CPU, the one Prism's targets compare with: bfloat16 where the CPU
    has bf16 dot products (AVX-512 BF16 or AMX), float32 elsewhere, where vLLM's bf16 is emulated
    (measured with prefix caching on (a): AVX2 2026-11-30, bf16 17.6 s and fp32 3.5 s; AVX-512 VNNI
    without BF16, an Intel Xeon (Ice Lake), 2026-12-06: docs/results.md)."""
    from kernels.cpu.features import cpu_has_bf16_itself

    return "bfloat16" if cpu_has_bf16_itself() else "float32"


def run_vllm(calls: list[list[tuple]], prefix_caching: bool, model_dir: Path, dtype: str = "bfloat16") -> dict:
    """The benchmarks' side (main virtualenv): run this script in .venv-vllm on `calls`, each a
    list of (prompt ids, candidate ids) submitted together; returns its OUT dict."""
    spec = {"model_dir": str(model_dir), "prefix_caching": prefix_caching, "dtype": dtype,
            "calls": [[{"prompt_ids": p, "candidate_ids": c} for p, c in call] for call in calls]}
    return run_driver(VLLM_PYTHON, __file__, spec)


def vllm_session(prefix_caching: bool, model_dir: Path, dtype: str = "bfloat16") -> DriverSession:
    """The same driver kept up for one call at a time (driver_io.DriverSession)."""
    return DriverSession(VLLM_PYTHON, __file__, {"model_dir": str(model_dir), "prefix_caching": prefix_caching,
                                                 "dtype": dtype})


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    calls, answer = driver_calls(spec)  # a phase's calls, or a session's one at a time
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import psutil
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=True, block_size=32,
              enable_prefix_caching=spec["prefix_caching"], seed=0)
    startup = time.perf_counter() - start
    if answer:
        answer({"ready": True})
    seconds, probabilities = [], []
    for call in calls:
        prompts = [TokensPrompt(prompt_token_ids=p["prompt_ids"]) for p in call]
        params = [SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=p["candidate_ids"]) for p in call]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        answers = []
        for out, p in zip(outputs, call):
            logprobs = out.outputs[0].logprobs[0]
            values = [logprobs[c].logprob for c in p["candidate_ids"]]
            top = max(values)
            weights = [math.exp(v - top) for v in values]
            answers.append([w / sum(weights) for w in weights])
        probabilities += answers
        if answer:
            answer({"seconds": seconds[-1], "probabilities": answers})
    me = psutil.Process()
    rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
    json.dump({"seconds": seconds, "probabilities": probabilities, "rss_bytes": rss, "startup_seconds": startup},
              open(sys.argv[2], "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
