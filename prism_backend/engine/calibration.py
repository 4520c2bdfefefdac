"""Calibration, in one place: the fixed prompts, the forwards that measure what quantisation needs,
and the disk cache that computes it once per checkpoint.

  exact  SmoothQuant's activation maxima (model/smoothing.py folds them into the weights);
  int8   GPTQ's 8-bit integers of every projection of the rotated model (model/rotation.py,
         model/gptq.py), from the Hessians of the projections' inputs, and each one's bias
         correction (its mean output error, from a second forward); the precision plan
         (EngineConfig.keep_exact) picks which of them are served.

The prompts (calibration_prompts.py): chat-formatted decision prompts over documents of the kinds
Prism serves. Fixed text, shipped with the package, distinct from the eval sets, so the smoothed
weights and the integers are reproducible.

The forwards are the fp32 model with every projection replaced by an exact fixed-point product
(`_replayable`, model/fixed_point.py): the statistics, hence the served bits, are then the same on
every x86-64 CPU, whatever its vector width, vendor or BLAS (tests/test_replay.py).

The cache: statistics and integers are a pure function of the checkpoint, Prism's code and the
libraries that run its forward, so a stored copy is what a new computation would give, bit for bit --
provided the copy is keyed by all of them. The key hashes: config.json, the name, size and
modification time of every *.safetensors file (not their contents: hashing a 14 GB checkpoint on
every start would cost more than calibrating), the tokenizer's files (the prompts' tokens), the
source of the prism_backend and kernels packages, the torch and transformers versions and the CPU's
vector capability (GPTQ's Cholesky factorisations are LAPACK's, whose last bits may differ between
CPUs: model/gptq.py). Anything else -- another
checkpoint, an edited module, another torch -- misses and calibrates again. Why it matters: an int8
engine build spends most of its time in the calibration forward, and every server start, model
load, instance, tensor-parallel rank 0 and healed stub builds one.

Where: PRISM_CALIBRATION_CACHE if set ("off" disables the cache), else $XDG_CACHE_HOME/prism/
calibration or ~/.cache/prism/calibration; a folder that cannot be written is skipped silently
(the statistics are then computed, as without a cache). Files are written to a temporary name and
renamed, so instances starting together never read a partial file. Each key's files are one entry;
after every store the least recently used entries go while the folder holds more than
PRISM_CALIBRATION_CACHE_LIMIT (default 10G; cache_eviction.py), and every hit counts as a use.

The shipped calibration: a checkpoint folder may carry its own, in `prism-calibration/` (written by
`prism export-repository`, ship()), which every build of that checkpoint reads before the cache above.
Its manifest names the code it was computed with (config.json, Prism's source, torch and transformers,
as the cache key -- but not the CPU: one calibration for a whole fleet, so every server serves the
exporter's integers whatever its CPU's LAPACK would round) and each weight file's size, modification
time and sha256 (the file is hashed only where its time differs: a copy that did not keep it). Any
mismatch and the build goes on to the cache, as if nothing were shipped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

import prism_backend

from .. import cache_eviction
from ..config import EngineConfig
from ..forest import EncodedRequest
from ..model.exact_matmul import timings_forgotten
from ..model.fixed_point import FixedPointLinear
from ..model.kernel_sources import kernels_version
from ..model.loader import load_model
from ..model.spec import ModelSpec
from ..model.transformer import ForestTransformer
from ..paths import user_cache_dir
from ..reproducibility import torch_threads
from ..text.prompt import PromptBuilder, render_prompt
from ..text.tasks import Task
from ..text.tokenizer import TOKENIZER_FILES, ChatTokenizer, load_tokenizer
from .calibration_prompts import DOCUMENTS, QUESTIONS, SYSTEM
from .forest_builder import build_forest

# ---- the prompts ---------------------------------------------------------------------------------
TASK = Task("calibration", None, "Which category fits best?", ("Billing", "Technical problem", "Legal", "Other"))
SMOOTHING_DOCUMENTS = 6  # SmoothQuant's statistics come from the first six documents (as they always have)


def calibration_requests(tokenizer: ChatTokenizer) -> list[EncodedRequest]:
    """SmoothQuant's prompts: one single-branch request per document (the whole prompt, rendered as
    every decision prompt is, as the branch). Only the forward's activations matter: the candidates
    are placeholders."""
    requests = []
    for doc in DOCUMENTS[:SMOOTHING_DOCUMENTS]:
        ids = tuple(tokenizer.encode(render_prompt(tokenizer, SYSTEM, doc, TASK)))
        requests.append(EncodedRequest((), (), (ids,), ((0, 1),)))
    return requests


def gptq_requests(tokenizer: ChatTokenizer, max_context: int) -> list[EncodedRequest]:
    """GPTQ's prompts: every document with every question, as a served request (root, trunk, four
    branches)."""
    builder = PromptBuilder(tokenizer, max_context)
    tasks = [Task("calibration", None, question, options) for question, options in QUESTIONS]
    return [builder.encode(SYSTEM, doc, tasks) for doc in DOCUMENTS]


# ---- the forward ---------------------------------------------------------------------------------
def calibration_stats(config: EngineConfig, full_model=None) -> list[dict]:
    """SmoothQuant statistics from a forward of the full model (exact products) over the shipped prompts,
    stored on disk for the next build of the same checkpoint and code (the cache below).
    full_model: (spec, weights) of the whole checkpoint; loaded here, only on a miss, if not given."""
    return _load_or_compute(config.model_dir, SMOOTHING,
                            lambda: _calibrate(config, *(full_model or load_model(config.model_dir))))


def _calibrate(config: EngineConfig, spec: ModelSpec, weights) -> list[dict]:
    from ..model.smoothing import calibrate

    tokenizer = load_tokenizer(config.model_dir)
    # each prompt as one forest with unsplit segments: the statistics do not depend on kv_block_tokens
    forests = [build_forest([r], block_tokens=spec.max_context) for r in calibration_requests(tokenizer)]
    # on the engine's threads: the forward's bits do not depend on their count (exact fixed-point
    # products, Prism's thread-invariant kernels)
    with torch_threads(config.num_threads):
        return calibrate(_replayable(ForestTransformer(spec, weights)), forests)


def gptq_integers(config: EngineConfig) -> list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """GPTQ's 8-bit integers and scales of every projection of the rotated full model, and the bias
    correction of each (its mean output error on the calibration rows, model/gptq.py), per layer
    {"qkv", "o", "gate_up", "down": (integers (out, in) int8, scales (out,) float32, correction
    (out,) float32)}; stored on disk for the next build of the same checkpoint and code."""
    tensors = _load_or_compute(config.model_dir, GPTQ, lambda: _integers_to_tensors(_gptq(config)), raw=True)
    return _integers_from_tensors(tensors)


def _gptq(config: EngineConfig) -> list[dict]:
    from ..model.gptq import quantize_layer_by_layer
    from ..model.rotation import rotate, rotated_vocab

    spec, weights = load_model(config.model_dir)
    # the rotated embedding and LM head through the cache's copy: the runner, building next, maps it
    # instead of rotating them a second time (2.6 s of a cold build)
    rotate(spec, weights, vocab=mapped_rows(config.model_dir, lambda: rotated_vocab(spec, weights),
                                            tuple(weights.embed.shape)))
    tokenizer = load_tokenizer(config.model_dir)
    forests = [build_forest([r], block_tokens=spec.max_context) for r in gptq_requests(tokenizer, spec.max_context)]
    model = _replayable(ForestTransformer(spec, weights, every_row=True))
    threads = config.num_threads or torch.get_num_threads()
    # the forward's bits do not depend on the thread count (quantize_layer_by_layer); the exact routes the
    # bias corrections' 8-bit projections time here are not the served model's (timings_forgotten)
    with torch_threads(threads), timings_forgotten():
        return quantize_layer_by_layer(model, forests, workers=threads)


def _replayable(model: ForestTransformer) -> ForestTransformer:
    """`model` (fp32) with every projection a FixedPointLinear (model/fixed_point.py): float32
    products sum in an order that depends on the CPU's BLAS, vector width and vendor, and these
    forwards decide the smoothed weights and the integers, so every served bit. The rest of the
    forward (norms, SwiGLU, attention, rotary) already has one operation order on every x86 CPU."""
    for p in model.proj:
        for name in ("qkv", "q", "kv", "o", "gate_up", "down"):
            linear = getattr(p, name)
            if linear is not None:
                setattr(p, name, FixedPointLinear(linear.weight, linear.bias))
    return model


def _integers_to_tensors(integers: list[dict]) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer, projections in enumerate(integers):
        for name, (q, scale, correction) in projections.items():
            tensors[f"{layer}.{name}.int"] = q.to(torch.int8).contiguous()
            tensors[f"{layer}.{name}.scale"] = scale.contiguous()
            tensors[f"{layer}.{name}.correction"] = correction.contiguous()
    return tensors


def _integers_from_tensors(tensors: dict[str, torch.Tensor]) -> list[dict]:
    layers: dict[int, dict] = {}
    for key in tensors:
        layer, name, part = key.split(".")
        if part == "int":
            layers.setdefault(int(layer), {})[name] = (tensors[key], tensors[f"{layer}.{name}.scale"],
                                                       tensors[f"{layer}.{name}.correction"])
    return [layers[i] for i in range(len(layers))]


# ---- the cache -----------------------------------------------------------------------------------
PACKAGE_ROOT = Path(prism_backend.__file__).resolve().parent
OFF = "off"
SMOOTHING, GPTQ, ROWS = "", "-gptq", "-rows"  # what an entry holds, as its file name's suffix
LIMIT_VARIABLE, DEFAULT_LIMIT = "PRISM_CALIBRATION_CACHE_LIMIT", "10G"  # the cache's size (cache_eviction.py)
KEY_LENGTH = 32  # hex digits of cache_key(), the first part of every file of an entry
ENTRY_FILE = re.compile(rf"\.?([0-9a-f]{{{KEY_LENGTH}}})(?:{GPTQ}|{ROWS})?\.safetensors")  # +.lock, +.<pid>


def cache_dir() -> Path | None:
    """The folder of stored statistics, or None when PRISM_CALIBRATION_CACHE=off."""
    if os.environ.get("PRISM_CALIBRATION_CACHE", "") == OFF:
        return None
    cache_eviction.limit(LIMIT_VARIABLE, DEFAULT_LIMIT)  # a bad limit fails the build now, not after calibrating
    return user_cache_dir("calibration", "PRISM_CALIBRATION_CACHE")


def _source_digest() -> str:
    """The engine's Python source and the kernels' version (the calibration forward runs Prism's CPU
    attention and row-wise passes, so a kernel edit can move its activations)."""
    digest = hashlib.sha256(kernels_version().encode())
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _code_key(model_dir: Path) -> str:
    """What the statistics depend on besides the weights and the CPU, hashed: the checkpoint's
    config.json and tokenizer (the prompts' tokens), Prism's source and the libraries that run the
    forward."""
    model_dir = Path(model_dir)
    tokenizer = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            tokenizer.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    parts = {
        "config": (model_dir / "config.json").read_text(),
        "tokenizer": tokenizer.hexdigest(),
        "source": _source_digest(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),  # its RoPE variants; no import
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_key(model_dir: Path) -> str:
    """What the statistics depend on, hashed (see the module docstring)."""
    parts = {
        "code": _code_key(model_dir),
        "weights": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in _weight_files(model_dir)],
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:KEY_LENGTH]


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def _to_tensors(stats: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{layer}.{name}": t.contiguous() for layer, entry in enumerate(stats) for name, t in entry.items()}


def _from_tensors(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    stats: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        layer, name = key.split(".", 1)
        stats.setdefault(int(layer), {})[name] = t
    return [stats[i] for i in range(len(stats))]


def entry(model_dir: Path, kind: str = SMOOTHING) -> Path | None:
    """The file that holds (or will hold) this checkpoint's statistics (kind SMOOTHING) or integers
    (GPTQ) for this code, or None when the cache is off. Computed once per build: it hashes the
    package source."""
    folder = cache_dir()
    return None if folder is None else folder / f"{cache_key(model_dir)}{kind}.safetensors"


def load(path: Path | None, raw: bool = False):
    """The statistics stored at `path` (entry()) -- or with `raw` the tensors as stored -- or None
    (no cache, a miss, an unreadable file)."""
    mapped = _mapped(path)
    if mapped is None:
        return None  # no cache, missing or damaged: calibrate again (and store a good copy)
    # copies: the mapped tensors view one mapping of the whole file, which any one of them kept would
    # keep mapped, with every page building read resident (71 of its 102 MiB in a replica)
    tensors = {name: tensor.clone() for name, tensor in mapped.items()}
    try:
        return tensors if raw else _from_tensors(tensors)
    except (ValueError, KeyError):
        return None  # not the layout this code stores: calibrate again


ROW_NAMES = ("embed", "lm_head")  # what mapped_rows stores


def mapped_rows(model_dir: Path, make: Callable[[], dict[str, torch.Tensor]],
                shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The rotated embedding and LM head ({"embed", "lm_head"}: (V, H) float32 each, `shape`) as
    views of their stored copy mapped from the cache -- `make()` computes them only where the cache
    has no such copy, and stores them -- not held in memory: a replica then has resident only the
    pages of the tokens it looks up and of the candidates it scores, where in memory both matrices
    are resident in full (2 x 108 MiB for SmolLM2-135M), and the instances and ranks on one machine
    share those pages. The same numbers: a stored copy is exact (tests/test_calibration_cache.py).
    Without a cache, or where it cannot be written, make()'s tensors as they are."""
    mapped = _mapped(shipped_entry(model_dir, ROWS))
    if _holds_rows(mapped, shape):
        _SOURCES[ROWS] = SHIPPED_SOURCE
        return {name: mapped[name] for name in ROW_NAMES}
    path = entry(model_dir, ROWS)
    mapped = _mapped(path)
    _SOURCES[ROWS] = CACHED_SOURCE
    if _holds_rows(mapped, shape):
        cache_eviction.mark_used(path)
    else:
        _SOURCES[ROWS] = "computed"
        rows = make()
        if store(path, rows, raw=True) is None:
            return rows
        mapped = _mapped(path)
        if not _holds_rows(mapped, shape):
            return rows
    return {name: mapped[name] for name in ROW_NAMES}


def _holds_rows(mapped: dict[str, torch.Tensor] | None, shape: tuple[int, int]) -> bool:
    return mapped is not None and all(name in mapped and tuple(mapped[name].shape) == tuple(shape)
                                      and mapped[name].dtype == torch.float32 for name in ROW_NAMES)


def _mapped(path: Path | None) -> dict[str, torch.Tensor] | None:
    """The tensors stored at `path` as views of one mapping of the file (safetensors' loader), or None."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if path is None:
        return None
    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError):
        return None


def _load_or_compute(model_dir: Path, kind: str, compute: Callable[[], object], raw: bool = False):
    """What the checkpoint ships of `kind` (shipped_entry()) or the cache holds (entry()), or else
    compute() -- by this build, stored for the next, or by another build that missed at the same
    time, whose file this one loads when its turn comes."""
    found = load(shipped_entry(model_dir, kind), raw=raw)
    if found is not None:
        _SOURCES[kind] = SHIPPED_SOURCE
        return found
    stored = entry(model_dir, kind)
    found = load(stored, raw=raw)
    _SOURCES[kind] = CACHED_SOURCE
    if found is not None:
        cache_eviction.mark_used(stored)
    else:
        with one_at_a_time(stored):
            found = load(stored, raw=raw)  # another build may have stored it while this one waited
            if found is None:
                found = compute()
                store(stored, found, raw=raw)
                _SOURCES[kind] = "computed"
    return found


@contextlib.contextmanager
def one_at_a_time(path: Path | None):
    """Held while this process computes what `path` (entry()) will hold: builds that miss together
    (instances, replicas and TP ranks starting on one machine) compute it one at a time, and each
    one after the first finds the first one's file when its turn comes. Beside each other on shared
    cores they took longer each than one after the other: two cold int8 builds on 2 cores, each on
    the engine's 2 threads, 260 s each against 72 s alone (AMD EPYC Zen 4, 2026-12-05). An advisory
    lock (flock) on a file beside the entry, released when its holder exits however it exits; with
    the cache off or not writable there is nothing to share, and nothing is held."""
    import fcntl

    if path is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.parent / f".{path.name}.lock", "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits for the build computing it now, if one is
        yield


def store(path: Path | None, stats, raw: bool = False) -> Path | None:
    """Keep `stats` (with `raw`: a dict of named tensors) at `path` (entry()) for the next process;
    the path, or None where nothing could be written."""
    from safetensors.torch import save_file

    if path is None:
        return None
    partial = path.parent / f".{path.name}.{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(stats if raw else _to_tensors(stats), partial)
        os.replace(partial, path)  # atomic: a concurrent reader sees the old state or the whole file
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        return None
    cache_eviction.evict(path.parent, cache_eviction.limit(LIMIT_VARIABLE, DEFAULT_LIMIT), entry_key,
                         keep=entry_key(path.name))
    return path


def entry_key(name: str) -> str | None:
    """The cache key a file of the cache belongs to (its entry's stored kinds, their locks and
    partial files), or None for a file that is not the cache's."""
    match = ENTRY_FILE.match(name)
    return match.group(1) if match else None


# ---- the shipped calibration ---------------------------------------------------------------------
SHIPPED = "prism-calibration"  # the folder inside a checkpoint
SHIPPED_MANIFEST = "manifest.json"
SHIPPED_FILES = {SMOOTHING: "smoothing.safetensors", GPTQ: "gptq.safetensors", ROWS: "rows.safetensors"}
SHIPPED_SOURCE, CACHED_SOURCE = "shipped with the checkpoint", "from this machine's cache"
KIND_NAMES = {SMOOTHING: "smoothing statistics", GPTQ: "GPTQ integers", ROWS: "rotated embedding and head"}
_SOURCES: dict[str, str] = {}  # kind -> where this process's current build read it from (sources())


def reset_sources() -> None:
    """A new build starts (engine/runner.py): sources() reports only what it reads."""
    _SOURCES.clear()


def sources() -> str:
    """Where this process's last build took its calibration from, for the model's ready log line:
    e.g. "GPTQ integers shipped with the checkpoint, rotated embedding and head shipped with the
    checkpoint"; "none" for a build that needs none (fp32, a W8A8 checkpoint)."""
    return ", ".join(f"{KIND_NAMES[kind]} {source}" for kind, source in _SOURCES.items()) or "none"


def needed(config: EngineConfig, quantized: bool) -> tuple[str, ...]:
    """The kinds a build of `config` reads (engine/runner.py): int8 GPTQ's integers and the rotated
    vocabulary rows, unless the checkpoint is `quantized` (a W8A8 checkpoint serves its own integers);
    exact SmoothQuant's statistics, unless smoothing is off; fp32 none."""
    if config.precision == "int8" and not quantized:
        return GPTQ, ROWS
    if config.precision == "exact" and config.smooth_alpha > 0:
        return (SMOOTHING,)
    return ()


def ship(config: EngineConfig) -> list[Path]:
    """Put in the checkpoint's folder (config.model_dir / SHIPPED) the calibration a build of
    `config` reads -- from this machine's cache, or computed now -- with the manifest that lets every
    other machine use it (shipped_entry()); the files written (none for fp32 or a W8A8 checkpoint).
    prism export-repository calls it on the copy it exports, so its servers start without calibrating."""
    from safetensors.torch import save_file

    from ..model.rotation import rotated_vocab

    model_dir = Path(config.model_dir)
    spec, weights = load_model(model_dir)
    made = {
        SMOOTHING: lambda: _to_tensors(calibration_stats(config, (spec, weights))),
        GPTQ: lambda: _load_or_compute(model_dir, GPTQ, lambda: _integers_to_tensors(_gptq(config)), raw=True),
        ROWS: lambda: mapped_rows(model_dir, lambda: rotated_vocab(spec, weights), tuple(weights.embed.shape)),
    }
    kinds = needed(config, quantized=weights.layers[0].integers is not None)
    if not kinds:
        return []
    folder = model_dir / SHIPPED
    folder.mkdir(exist_ok=True)
    (folder / SHIPPED_MANIFEST).unlink(missing_ok=True)  # what was shipped before is not read while shipping
    written = []
    for kind in kinds:
        written.append(folder / SHIPPED_FILES[kind])
        save_file({name: t.contiguous() for name, t in made[kind]().items()}, written[-1])
        written[-1].chmod(0o644)  # a fleet's server may run as another user than the exporter
    manifest = {
        "code": _code_key(model_dir),
        "weights": {p.name: _weight_record(p) for p in _weight_files(model_dir)},
        "files": {KIND_NAMES[kind]: SHIPPED_FILES[kind] for kind in kinds},
    }
    (folder / SHIPPED_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return [folder / SHIPPED_MANIFEST, *written]


def shipped_entry(model_dir: Path, kind: str = SMOOTHING) -> Path | None:
    """The checkpoint's own file of `kind` (ship()), or None: none shipped, or shipped for other code
    or other weights."""
    manifest, _ = _shipped_manifest(model_dir)
    if manifest is None or SHIPPED_FILES[kind] not in manifest["files"].values():
        return None
    return Path(model_dir) / SHIPPED / SHIPPED_FILES[kind]


def _shipped_manifest(model_dir: Path) -> tuple[dict | None, str]:
    """(the shipped manifest where it belongs to this code and these weights, else None; and why not)."""
    try:
        manifest = json.loads((Path(model_dir) / SHIPPED / SHIPPED_MANIFEST).read_text())
        if not isinstance(manifest["files"], dict):
            return None, "the shipped manifest is unreadable"
        if manifest["code"] != _code_key(model_dir) or not _same_weights(model_dir, manifest["weights"]):
            return None, "shipped for other code or other weights"
        return manifest, ""
    except FileNotFoundError:
        return None, "no calibration shipped"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, "the shipped manifest is unreadable"


# EngineConfig fields that do not move a bit (the engine's tested invariants: thread count, tensor
# parallelism) or that name where, not what (model_dir: the manifest checks the weights themselves)
BIT_NEUTRAL_FIELDS = ("model_dir", "num_threads", "tp_size")


def _bits_config(config: EngineConfig) -> dict:
    """The configuration a digest of served bits belongs to, as JSON values."""
    fields = dataclasses.asdict(config)
    return json.loads(json.dumps({k: v for k, v in fields.items() if k not in BIT_NEUTRAL_FIELDS}, default=str))


def record_exported_bits(config: EngineConfig, digests: list[str]) -> None:
    """Add to the shipped manifest (ship()) the digests of the startup self-check's requests as the
    exporting machine serves them under `config` (serving/decision_step.py): every server that
    loads the checkpoint with this configuration then checks at start that it gives the same bits."""
    path = Path(config.model_dir) / SHIPPED / SHIPPED_MANIFEST
    manifest = json.loads(path.read_text())
    manifest["exported_bits"] = {"config": _bits_config(config), "digests": list(digests)}
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def exported_bits(config: EngineConfig) -> tuple[list[str] | None, str]:
    """(the self-check digests recorded at export, or None, and why not): None where nothing was
    shipped for this code and these weights, or it was shipped for another configuration."""
    manifest, why = _shipped_manifest(config.model_dir)
    if manifest is None:
        return None, why
    recorded = manifest.get("exported_bits")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("config"), dict):
        return None, "no bits recorded at export"
    mine = _bits_config(config)
    if recorded["config"] != mine:
        differ = sorted(k for k in mine.keys() | recorded["config"].keys() if recorded["config"].get(k) != mine.get(k))
        return None, f"configured unlike the export ({', '.join(differ)})"
    return list(recorded["digests"]), "recorded at export"


def _weight_record(path: Path) -> dict:
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(path)}


def _same_weights(model_dir: Path, shipped: dict) -> bool:
    """Are the checkpoint's weight files those the calibration was computed from? Size and time as
    recorded, or else (a copy that did not keep the time) the same sha256."""
    files = _weight_files(model_dir)
    if sorted(p.name for p in files) != sorted(shipped):
        return False
    for path in files:
        recorded, stat = shipped[path.name], path.stat()
        if stat.st_size != recorded["bytes"]:
            return False
        if stat.st_mtime_ns != recorded["mtime_ns"] and file_sha256(path) != recorded["sha256"]:
            return False
    return True


def file_sha256(path: Path) -> str:
    """The file's sha256, hashed once per process while its size and time stay the same: a build's
    second look at an unchanged file (GPTQ's entry, then the rows'), or an export's manifest after
    ship(), reads the first one's answer."""
    stat = Path(path).stat()
    return _sha256(Path(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """file_sha256's memo: size and time are part of the key, not read here."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
