"""One sha256 over the float32 probabilities of a fixed set of decisions, in every engine setting
whose bits a refactoring must keep: int8 and fp32, prefix cache off and on (cold, then warm), tensor
parallelism 1 and 2 (in-process: rank 0 here, rank 1 a worker process).

    .venv/bin/python bench/bit_digest.py

Two models: the embedded SmolLM2 in fp32, and a tiny random Qwen3 (2 layers, hidden 64, built
from a fixed seed with SmolLM2's tokenizer, as the tests build it) in int8 and fp32. Only the tiny
model runs int8 because on a CPU without AVX-512 VNNI `torch._int_mm` takes a slow path (~20 s for
one 1,638 x 1,536 x 576 product on these machines), so the embedded model in int8 takes hours; the
tiny model runs the same code (smoothing, int8 linears, TP shards) in seconds.

Prints one digest per setting (and the tiny checkpoint's own sha256: equal weights on both sides)
and the digest of them all. Equal digests before and after a change mean not one probability bit
moved. One thread: fp32 GEMMs reduce in a thread-count-dependent order.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from prism_backend.config import EngineConfig  # noqa: E402
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH as REGISTRY  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402

THREADS = 1  # one: on a shared machine a 2-thread OpenMP pool mostly waits for its other thread
BATCH_SIZE = 5


def inline(question: str, *options: str) -> str:
    return json.dumps({"question": question, "options": list(options)})


# Short texts: each setting runs the model on ~1,300 rows per pass, so all eight fit in minutes even
# on a busy machine. WIDE has more options than max_candidates (16): the full-vocabulary path.
WIDE = inline("Which product?", *[f"P{i}" for i in range(18)])
SHORT = [inline("Urgent?", "Yes", "No"), inline("Topic?", "Billing", "Bug", "Sales"),
         inline("Mood?", "Calm", "Upset"), inline("Reply by?", "Today", "This week")]
FIFTH = ["severity@1", WIDE, inline("Spam?", "Yes", "No")]
MATERIALS = [
    "I was charged twice for my plan this month.",
    "The app crashes when I upload a photo.",
    "Can we get a quote for 40 more seats?",
    "Checkout fails for all EU customers since 9:00.",
    "Please delete my account and all my data.",
    "Your update broke the export to CSV again!!",
    "How do I change the billing address on invoices?",
    "The dashboard is slow but works.",
]


def requests() -> list[dict]:
    """10 requests, 51 decisions: 5 tasks each on 8 materials (one asked twice, one under a
    second system prompt), registered and inline tasks, candidate and full-vocabulary paths."""
    out = [{"material": m, "tasks": SHORT + [FIFTH[i % len(FIFTH)]]} for i, m in enumerate(MATERIALS)]
    out.append({"material": MATERIALS[0], "tasks": ["team", "reply_time"] + SHORT[:3]})
    out.append({"material": MATERIALS[3], "tasks": ["severity", WIDE] + SHORT, "system": "Answer with one letter."})
    return out


TINY_DIR = ROOT / ".run" / "bit_digest" / "tiny-qwen3"
SETTINGS = [  # (name, model, EngineConfig changes)
    *[(f"tiny {precision} tp{tp} cache-{'on' if cache else 'off'}", "tiny",
       dict(precision=precision, tp_size=tp, prefix_cache_bytes=cache))
      for precision in ("int8", "fp32") for tp in (1, 2) for cache in (0, 1 << 28)],
    *[(f"smollm2 fp32 tp{tp} cache-{'on' if cache else 'off'}", "embedded",
       dict(precision="fp32", tp_size=tp, prefix_cache_bytes=cache)) for tp in (1, 2) for cache in (0, 1 << 28)],
]


def tiny_model() -> Path:
    """A random Qwen3 (q/k norms, GQA, untied head) from a fixed seed, with SmolLM2's tokenizer."""
    if not (TINY_DIR / "config.json").exists():
        import shutil

        import torch
        from transformers import AutoModelForCausalLM, Qwen3Config

        torch.manual_seed(1)
        config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                             initializer_range=0.15, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             use_sliding_window=False)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(TINY_DIR, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (DEFAULT_MODEL_DIR / name).exists():
                shutil.copy(DEFAULT_MODEL_DIR / name, TINY_DIR / name)
    return TINY_DIR


def probability_bytes(pipeline: DecisionPipeline, batch: list[dict]) -> bytes:
    results, _ = pipeline.decide_many(batch)
    out = b""
    for result in results:
        if isinstance(result, Exception):
            raise result
        for decision in result:
            out += np.array(list(decision["probabilities"].values()), np.float32).tobytes()
    return out


def setting_digest(model_dir: Path, changes: dict, workload: list[dict]) -> tuple[str, int]:
    """Every batch scored once, with the cache on twice (cold, then warm) -> sha256, decisions per pass."""
    config = EngineConfig(model_dir=model_dir, num_threads=THREADS, **changes)
    pipeline = DecisionPipeline(config, REGISTRY)
    try:
        h = hashlib.sha256()
        batches = [workload[i : i + BATCH_SIZE] for i in range(0, len(workload), BATCH_SIZE)]
        for _ in range(2 if changes.get("prefix_cache_bytes") else 1):
            for batch in batches:
                h.update(probability_bytes(pipeline, batch))
        return h.hexdigest(), sum(len(r["tasks"]) for r in workload)
    finally:
        pipeline.engine.close()


def main() -> int:
    workload = requests()
    models = {"tiny": tiny_model(), "embedded": DEFAULT_MODEL_DIR}
    weights = hashlib.sha256((models["tiny"] / "model.safetensors").read_bytes()).hexdigest()
    print(f"{'tiny checkpoint':26s} {weights}", flush=True)
    total = hashlib.sha256()
    for name, model, changes in SETTINGS:
        start = time.monotonic()
        digest, decisions = setting_digest(models[model], changes, workload)
        print(f"{name:26s} {decisions} decisions  {digest}  ({time.monotonic() - start:.0f} s)", flush=True)
        total.update(digest.encode())
    print(f"{'all settings':26s} {total.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
