"""One validated configuration object for the engine, and the small part of it the model computes with.

Every knob of Prism lives here with its default. `config.pbtxt` parameters (strings, as Triton
hands them over) and CLI flags are both turned into an `EngineConfig` through `from_parameters`,
so a default is written down exactly once, and each value's range is checked here, once.
`ComputeSettings` (precision, quantisation passes, kernels, TP group) is what the model and each
of its linear maps are handed.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# int8: 8-bit x 8-bit products on a rotated, GPTQ-rounded model (model/rotation.py, model/gptq.py),
#       the projections named in `keep_exact` in the exact scheme; exact: every projection in the
#       exact integer scheme (13-bit integers by default, SmoothQuant-smoothed); fp32: float32.
PRECISIONS = ("int8", "exact", "fp32")
PROJECTIONS = ("qkv", "o", "gate_up", "down")
KERNEL_BACKENDS = ("auto", "torch", "triton")
# Prism's CPU tree attention in float32 or in integers with exact int32 sums
# (kernels/cpu/tree_attention.py); "auto": integers under int8, float32 under exact and fp32
ATTENTIONS = ("auto", "integer", "float")
# config.pbtxt parameters Triton's Python backend reads itself, not the engine: EXECUTION_ENV_PATH
# names the packed Python environment of an exported repository (prism_launcher/export.py).
BACKEND_PARAMETERS = ("EXECUTION_ENV_PATH",)
DEFAULT_SYSTEM_PROMPT = (
    "You are a careful decision assistant. Read the material and answer the question "
    "with the letter of the single best option."
)


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message says what to change."""


@dataclass(frozen=True)
class ComputeSettings:
    """How the model computes; its defaults are the plain fp32 model (calibration, tests)."""

    precision: str = "fp32"
    act_passes: int = 1  # the exact scheme's activation quantisation passes (model/quant.py)
    weight_passes: int = 1  # the exact scheme's weight quantisation passes
    kernels: str = "auto"  # see EngineConfig.kernels
    attention: str = "auto"  # see EngineConfig.attention
    group: Any = None  # this rank's model.tp.TPGroup under tensor parallelism, else None

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not 1 <= self.act_passes <= 3:
            raise ConfigError(f"act_passes must be 1, 2 or 3, got {self.act_passes}")
        if self.weight_passes not in (1, 2):
            raise ConfigError(f"weight_passes must be 1 or 2, got {self.weight_passes}")
        if self.kernels not in KERNEL_BACKENDS:
            raise ConfigError(f"kernels must be one of {KERNEL_BACKENDS}, got {self.kernels!r}")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("kernels='triton' needs a CUDA device, or TRITON_INTERPRET=1 set in the "
                                  "environment before start to run the kernels through Triton's interpreter")

    @property
    def integer_attention(self) -> bool:
        """Whether Prism's CPU tree attention computes in integers (where it runs: kernels auto, CPU)."""
        return self.attention == "integer" or (self.attention == "auto" and self.precision == "int8")

    def with_group(self, group) -> "ComputeSettings":
        """The same settings on one rank of a tensor-parallel group (None: unsplit)."""
        return dataclasses.replace(self, group=group)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    precision: str = "int8"  # see PRECISIONS
    # Under int8, the projections kept in the exact scheme (the precision plan, engine/calibration.py):
    # comma-separated names out of PROJECTIONS, each for every layer, one ("down@0") or a range of
    # layers, both ends included ("qkv@0-14"); "" = none. An item may name its own passes, activations
    # + weights ("down:1+2": 8-bit activations on 13-bit weights), else act_passes + weight_passes.
    # The default keeps down_proj and qkv exact (59% of the MACs in 8 bits): on the full eval it beats
    # bf16 on every measure with two different calibrations; down alone (75%) did once and missed bf16's
    # agreement with another, nothing kept exact misses it (docs/eval.md).
    keep_exact: str = "down,qkv"
    # The exact scheme's passes per token and per weight (model/quant.py): P passes = integers up to
    # 127 * 128^(P-1); two each (13-bit integers) are ~1e-3 off fp32 (one each is plain, unrotated W8A8).
    act_passes: int = 2
    weight_passes: int = 2
    smooth_alpha: float = 0.5  # SmoothQuant migration strength of the exact scheme; 0 = no smoothing
    max_candidates: int = 16  # tasks with more options take the full-vocabulary fallback
    max_options: int = 26  # options are lettered A..Z; more cannot be asked in one letter
    max_tasks_per_request: int = 32
    # Checked before tokenizing (which costs ~1 s per MiB): a material at the model's whole context
    # is at most max_context x the longest token's bytes (SmolLM2: 8192 x 81 B = 648 KiB).
    max_material_bytes: int = 1024 * 1024
    tp_size: int = 1
    # How long the ranks of a tensor-parallel group wait for each other (the workers load their
    # shards meanwhile), and the timeout of the group's collectives.
    tp_startup_timeout_s: int = 600
    num_threads: int = 0  # 0: leave torch's default
    # Which code runs attention and the exact integer products: "auto" = the Triton-lang kernels
    # (kernels/triton/) for CUDA tensors; for CPU tensors Prism's CPU kernels (tree attention with the
    # same bits on every x86 CPU kind, for heads of 64, and the exact GEMMs, model/exact_matmul.py);
    # "torch" = torch's CPU attention (and the exact GEMMs); "triton" forces the Triton-lang kernels
    # (on CPU tensors it needs TRITON_INTERPRET=1 in the environment before start: how the tests run them).
    kernels: str = "auto"
    # How Prism's CPU tree attention computes (with kernels auto, for CPU tensors and heads of 64):
    # "integer" = q and k as 14-bit, v as 12-bit integers per row and head, the softmax weights as
    # 15-bit ones, every dot product an exact int32 sum (vpdpwssd / vpmaddwd): ~1.4x faster than
    # float32 on AVX-512 VNNI, ~5e-4 relative error per layer (kernels/cpu/tree_attention.py);
    # "float" = float32 FMAs; "auto" = integer under int8 (the fast default), float under exact (the
    # accuracy rung) and fp32 (the reference). Both give the same bits on every x86 CPU kind.
    attention: str = "auto"
    # Prefix KV cache and chunked prefill (engine/prefix_cache.py, engine/forest_builder.py). System prompt and material are
    # cut into blocks of kv_block_tokens: the unit of the cache and of prefill chunks.
    kv_block_tokens: int = 128
    prefix_cache_bytes: int = 256 * 1024 * 1024  # K/V held across batches, LRU-evicted; 0 = no cache
    prefill_chunk_tokens: int = 2048  # most rows computed in one pass over the layers; 0 = no limit
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    # Admission by time (serving/scheduler.py): a request is queued only if it can be answered within
    # this many seconds of its arrival at the decision step; otherwise it gets UNAVAILABLE (HTTP 503)
    # at once, with a hint of when to retry.
    max_queue_wait_s: float = 10.0
    # Batching (serving/scheduler.py). A batch (one forest) holds at most this many prompt rows, rows
    # its requests share counted once (a request alone may hold more): a batch's time follows its
    # rows, and an urgent request waits for the bulk batch in flight (its own batch takes no bulk
    # requests). 1600 rows hold three unrelated ~200-token tickets, or three questions whose
    # ~600-token materials share a quarter of their text or more (1561 rows at a quarter: with
    # 1024 they went in three forests, each computing the shared text again where the cache is off),
    # in one forest. The urgent lane's wait measured no longer than with 1024 on the engine of
    # 2026-12-03's afternoon (bench/results/priority.md: urgent median / p90 307 / 329 ms against
    # 363 / 509); 2048 had made it 1.4x longer on the slower engine of that morning. 0 = no row budget.
    max_batch_rows: int = 1600
    # An idle decision step waits up to this long after a request arrives for the requests sent with
    # it: they arrive a few ms apart, each after its own tokenizer step (measured on (b), 3 tickets
    # sent at once: all three within 2-6 ms; without waiting, the first was scored alone and the
    # other two after it). Each request arriving within the window stretches it to gather_ms after
    # its own arrival, up to scheduler.GATHER_SPAN windows after the first (three long materials
    # arrive further apart: their tokenizer steps run one after another). 0 = start at once.
    gather_ms: float = 8.0

    def __post_init__(self):
        _ = self.compute  # building the compute settings checks precision, passes and kernels
        self._check_plan()
        if self.precision == "int8" and (self.act_passes, self.weight_passes) == (1, 1):
            # before 2026-12-01, int8 was the exact scheme and this its 8-bit rung
            raise ConfigError("act_passes=1 with weight_passes=1 under precision 'int8' was the old 8-bit rung: "
                              "precision 'int8' is now 8-bit by itself (rotated, GPTQ-rounded); plain "
                              "round-to-nearest 8-bit is precision 'exact' with act_passes=1, weight_passes=1")
        if not 2 <= self.max_candidates <= self.max_options:
            raise ConfigError(
                f"max_candidates must be between 2 and {self.max_options}, got {self.max_candidates}"
            )
        for name, least in (("max_tasks_per_request", 1), ("max_material_bytes", 1), ("tp_size", 1),
                            ("tp_startup_timeout_s", 1), ("num_threads", 0), ("kv_block_tokens", 1)):
            if getattr(self, name) < least:
                raise ConfigError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not 0 <= self.smooth_alpha < 1:
            raise ConfigError(f"smooth_alpha must be in [0, 1), got {self.smooth_alpha}")
        if self.max_batch_rows < 0 or self.gather_ms < 0:
            raise ConfigError(f"max_batch_rows and gather_ms must be >= 0, got {self.max_batch_rows}, {self.gather_ms}")
        if not self.max_queue_wait_s > 0:
            raise ConfigError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")
        if self.prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes must be >= 0 (0 disables the cache), got {self.prefix_cache_bytes}")
        if self.prefill_chunk_tokens and self.prefill_chunk_tokens < self.kv_block_tokens:
            raise ConfigError(f"prefill_chunk_tokens ({self.prefill_chunk_tokens}) must be 0 (no chunking) or at "
                              f"least kv_block_tokens ({self.kv_block_tokens})")

    @property
    def exact_plan(self) -> tuple[tuple[str, int | None], ...]:
        """keep_exact parsed: (projection, layer or None for every layer) pairs."""
        return tuple((name, layer) for name, layer, _ in self._plan_items())

    def _plan_items(self) -> list[tuple[str, int | None, tuple[int, int] | None]]:
        """keep_exact parsed: (projection, layer or None, the item's own (act, weight) passes or None)."""
        plan = []
        for item in filter(None, (part.strip() for part in self.keep_exact.split(","))):
            # name[@first[-last]][:act+weight]
            match = re.fullmatch(r"([^@:]+)(?:@([0-9]+)(?:-([0-9]+))?)?(?::([0-9])\+([0-9]))?", item)
            name, first, last, act, weight = match.groups() if match else (None,) * 5
            if name not in PROJECTIONS or (last is not None and int(last) < int(first)):
                raise ConfigError(f"keep_exact: {item!r} is not a projection out of {PROJECTIONS}, optionally with "
                                  "@layer or @first-last and :act+weight passes (e.g. 'down', 'down@0', 'qkv@0-14', "
                                  "'down:1+2')")
            passes = None if act is None else (int(act), int(weight))
            if passes is not None:
                if passes == (1, 1):
                    raise ConfigError(f"keep_exact: {item!r} asks for 1+1 passes, the projection's 8-bit form: "
                                      f"leave {name} out of keep_exact to serve its GPTQ-rounded 8-bit integers")
                try:
                    ComputeSettings(self.precision, *passes)  # checks the pass counts
                except ConfigError as error:
                    raise ConfigError(f"keep_exact: {item!r}: {error}") from None
            layers = [None] if first is None else range(int(first), int(last or first) + 1)
            plan.extend((name, layer, passes) for layer in layers)
        return plan

    def _check_plan(self) -> None:
        """keep_exact parses, and names no projection of a layer twice with different passes (exact_passes
        raises on a clash; layer -1, which no item names, compares the all-layer items alone)."""
        for name, layer, _ in self._plan_items():
            self.exact_passes(name, -1 if layer is None else layer)

    def exact_passes(self, name: str, layer: int) -> tuple[int, int] | None:
        """The (act, weight) passes of projection `name` of `layer` under int8 where the plan keeps it
        exact (its item's own, else act_passes and weight_passes), None where it runs in 8 bits."""
        found = {passes or (self.act_passes, self.weight_passes)
                 for n, at, passes in self._plan_items() if n == name and at in (None, layer)}
        if len(found) > 1:
            raise ConfigError(f"keep_exact names {name} of {'every layer' if layer < 0 else f'layer {layer}'} with "
                              "different passes: "
                              + ", ".join(f"{a}+{w}" for a, w in sorted(found)))
        return found.pop() if found else None

    def keeps_exact(self, name: str, layer: int) -> bool:
        """Whether projection `name` of `layer` runs in the exact scheme under int8."""
        return self.exact_passes(name, layer) is not None

    @property
    def compute(self) -> ComputeSettings:
        """What the model computes with (without a TP group: the runner adds its rank's)."""
        return ComputeSettings(self.precision, self.act_passes, self.weight_passes, self.kernels, self.attention)

    @classmethod
    def from_parameters(cls, params: dict[str, str], base_dir: Path | None = None) -> "EngineConfig":
        """Build from string parameters (Triton `config.pbtxt` or CLI).

        `model_dir` may be relative: it resolves against `base_dir` (the Triton model's own
        directory), never against the process's working directory. The environment variable
        PRISM_MODEL_DIR overrides it, for containers that mount weights elsewhere.
        """
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ConfigError(f"unknown parameter(s) {unknown}; known: {sorted(known)}")
        values: dict[str, object] = {}
        for name, raw in params.items():
            if "${" in str(raw):
                raise ConfigError(f"parameter {name!r} still holds the unfilled template {raw!r}")
            kind = known[name].type
            if kind in ("int", "float"):
                try:
                    values[name] = int(raw) if kind == "int" else float(raw)
                except ValueError:
                    raise ConfigError(f"parameter {name!r} must be a number ({kind}), got {raw!r}") from None
            else:
                values[name] = raw
        model_dir = os.environ.get("PRISM_MODEL_DIR") or values.get("model_dir")
        if not model_dir:
            raise ConfigError("parameter 'model_dir' is required: a Hugging Face checkpoint directory")
        model_dir = Path(model_dir)
        if not model_dir.is_absolute() and base_dir is not None:
            model_dir = Path(base_dir) / model_dir
        values["model_dir"] = model_dir.resolve()
        return cls(**values)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
