"""Times llama.cpp (llama-cpp-python, GGUF Q8_0) on prompts given as token ids; runs inside its own
virtualenv (LLAMA_PYTHON, `.venv-llama`, which `make bench` builds; `.venv-llama-avx2`, without
AVX-512, under `make bench-forced-avx2`).

    .venv-llama/bin/python bench/llama_cpp_driver.py IN.json OUT.json
    .venv/bin/python bench/llama_cpp_driver.py --convert MODEL_DIR OUT.gguf   (what `make bench` runs)

IN:  {"gguf": str, "threads": int, "calls": [[{"prompt_ids": [int], "candidate_ids": [int]}, ...], ...]}
     Calls run one after another; the prompts of a call one after another too (llama.cpp's Python
     binding has no concurrent requests), each reusing the KV cache of the longest prefix it shares
     with the previous prompt (what a llama.cpp server's slot does), so a ticket asked three questions
     is read once.
OUT: {"seconds": [per call], "probabilities": [[per prompt, softmax over its candidates' logits]],
      "rss_bytes": int, "startup_seconds": float}

`--convert` (main virtualenv) converts the checkpoint to GGUF Q8_0 with the converter the
llama-cpp-python source of the same version ships (vendor/llama.cpp/convert_hf_to_gguf.py, its
gguf-py beside it; sentencepiece installed next to them only so that the Llama converter can find
there is no SentencePiece model and fall back to the checkpoint's BPE tokenizer.json).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from driver_io import DriverSession, driver_calls, run_driver

ROOT = Path(__file__).resolve().parent.parent
# llama.cpp built for this CPU's instructions (`make bench`), or without AVX-512 where an AVX-512 machine
# is forced onto the AVX2 path (`make bench-forced-avx2`: bench/forced_avx2.py)
LLAMA_PYTHON = ROOT / (".venv-llama-avx2" if os.environ.get("PRISM_CPU_ISA") == "avx2" else ".venv-llama") / "bin" / "python"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the Makefile's .venv-llama installs the same
DEFAULT_GGUF = ROOT / ".run" / "SmolLM2-135M-Instruct-Q8_0.gguf"


def convert(model_dir: Path, out: Path) -> None:
    """model_dir (HF safetensors) -> out (GGUF Q8_0), with the converter of the binding's source."""
    work = ROOT / ".run" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
    converter = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    if not converter.exists():
        subprocess.run([*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", str(work),
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], check=True)
        subprocess.run(["tar", "-xzf", str(work / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"), "-C",
                        str(work)], check=True)
        subprocess.run([*pip, "install", "--target", str(work / "deps"), "sentencepiece"], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(converter / "gguf-py"), str(work / "deps")]))
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(converter / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "q8_0",
                    "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)


def run_llama_cpp(calls: list[list[tuple]], gguf: Path, threads: int) -> dict:
    """The benchmarks' side: run this script in .venv-llama on `calls`; returns its OUT dict."""
    spec = {"gguf": str(gguf), "threads": threads,
            "calls": [[{"prompt_ids": p, "candidate_ids": c} for p, c in call] for call in calls]}
    return run_driver(LLAMA_PYTHON, __file__, spec)


def llama_cpp_session(gguf: Path, threads: int) -> DriverSession:
    """The same driver kept up for one call at a time (driver_io.DriverSession)."""
    return DriverSession(LLAMA_PYTHON, __file__, {"gguf": str(gguf), "threads": threads})


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    calls, answer = driver_calls(spec)  # a phase's calls, or a session's one at a time
    import numpy as np
    import psutil
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=4096, n_batch=512, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], logits_all=False, verbose=False, seed=0)
    startup = time.perf_counter() - start
    if answer:
        answer({"ready": True})
    seconds, probabilities = [], []
    for call in calls:
        t0 = time.perf_counter()
        answers = []
        for p in call:
            ids = p["prompt_ids"]
            # keep the cached prefix, but recompute at least the last token (its logits are the answer)
            keep = min(common_prefix(list(llm.input_ids[: llm.n_tokens]), ids), len(ids) - 1)
            llm.n_tokens = keep  # eval() drops the KV cache past n_tokens first
            llm.eval(ids[keep:])
            # without logits_all only the last position's logits are computed: (n_vocab,)
            last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            logits = last[p["candidate_ids"]].astype(np.float64)
            top = logits.max()
            weights = [math.exp(v - top) for v in logits]
            answers.append([w / sum(weights) for w in weights])
        seconds.append(time.perf_counter() - t0)
        probabilities += answers
        if answer:
            answer({"seconds": seconds[-1], "probabilities": answers})
    rss = psutil.Process().memory_info().rss
    json.dump({"seconds": seconds, "probabilities": probabilities, "rss_bytes": rss, "startup_seconds": startup},
              open(sys.argv[2], "w"))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--convert"]:
        convert(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
