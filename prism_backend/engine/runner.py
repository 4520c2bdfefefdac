"""Build the (possibly sharded) model, and run forests through it with the prefix cache and chunks.

Shared by the engine (rank 0) and the tensor-parallel workers (tp_worker.py): every rank builds the
same forest from the same requests, looks up and fills its own prefix cache (the same decisions on
every rank, since the cache accounts each block at its full-model size), and runs the same chunks,
so the collectives inside the layers line up.
"""
from __future__ import annotations

import ctypes
import gc

import torch

from ..config import EngineConfig
from ..forest import EncodedRequest, Forest
from .forest_builder import build_forest
from ..model.loader import load_model
from ..model.spec import ModelSpec, load_config, spec_from_config
from ..model.rotation import down_block, rotate, rotated_vocab
from ..model.smoothing import apply_smoothing
from ..model.tp import TPGroup, local_spec, plan_shards, shard_integers, shard_stats
from ..model.transformer import ForestTransformer
from . import calibration
from .prefix_cache import CacheEntry, PrefixCache


def build_model(config: EngineConfig, group: TPGroup | None = None):
    """-> (the checkpoint's full spec, this rank's ForestTransformer, the LM head (V, H)).

    int8: the checkpoint rotated (model/rotation.py), its projections GPTQ's 8-bit integers
    (calibration.gptq_integers) except those the plan keeps exact -- or, for a W8A8 checkpoint, all
    its own integers unrotated, whatever the plan; exact: SmoothQuant-smoothed and
    rounded at load; fp32 as stored. Under tensor parallelism rank 0 computes (or loads) what the
    full model needs and every rank takes its shard of it, so each holds what TP = 1 would."""
    spec = spec_from_config(load_config(config.model_dir))
    shard = None if group is None else plan_shards(spec, group.world)[group.rank]
    first = group is None or group.rank == 0
    _, weights = load_model(config.model_dir, shard)
    quantized = weights.layers[0].integers is not None  # a W8A8 checkpoint: its own integers, as they are
    integers = stats = None
    # int8 on a W8A8 checkpoint serves every projection's own integers: the precision plan
    # (keep_exact) chooses among Prism's own calibrations, and a checkpoint rounded to 8 bits
    # elsewhere has no 13-bit weights to keep
    calibration.reset_sources()
    kinds = calibration.needed(config, quantized)
    if calibration.GPTQ in kinds:
        integers = calibration.gptq_integers(config) if first else None
    elif calibration.SMOOTHING in kinds:
        # statistics must equal TP = 1's: one fp32 forward of the whole model (these weights when unsplit)
        stats = calibration.calibration_stats(config, None if group else (spec, weights)) if first else None
    if group is not None:
        integers, stats = group.broadcast((integers, stats))
    mine = local_spec(spec, shard)
    if integers is not None:
        # the rotated embedding and LM head mapped from the cache: computed only where it has none
        vocab = calibration.mapped_rows(config.model_dir, lambda: rotated_vocab(mine, weights),
                                        tuple(weights.embed.shape))
        for i, (lw, layer) in enumerate(zip(weights.layers, shard_integers(integers, spec, shard))):
            passes = {name: config.exact_passes(name, i) for name in layer}  # None: served in 8 bits
            lw.integers = {name: ints for name, ints in layer.items() if passes[name] is None}
            lw.passes = {name: kept for name, kept in passes.items() if kept is not None}
            lw.drop_float_weights(lw.integers)  # GPTQ's integers replace them: rotating them would be waste
        rotate(mine, weights, down_block(spec.intermediate_size), vocab)
    if config.precision != "int8":
        for lw in weights.layers:  # exact and fp32 compute from the (dequantised) float weights
            lw.integers = None
    if stats is not None:
        apply_smoothing(mine, weights, shard_stats(stats, spec, shard), config.smooth_alpha,
                        None if group is None else group.all_reduce_max)
    compute = config.compute if group is None else config.compute.with_group(group)
    model = ForestTransformer(mine, weights, compute)
    return_freed_heap()
    return spec, model, weights.lm_head


def return_freed_heap() -> None:
    """Hand the heap that building freed back to the OS. Loading, rotating and GPTQ free about 1 GB of
    float temporaries (the dequantised checkpoint, Hessians, float copies of the integer weights) that
    glibc would otherwise keep mapped for the process's lifetime: a replica's resident memory would
    be about three times its live tensors (docs/results.md, "Memory of one replica")."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator returns memory its own way
        pass


def full_kv_bytes_per_token(spec: ModelSpec) -> int:
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4  # K and V, float32


class ForestRunner:
    """Requests -> forest -> answer hidden states, with the prefix cache and chunked prefill."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model: ForestTransformer):
        self.config = config
        self.model = model
        self.cache = None
        if config.prefix_cache_bytes:
            self.cache = PrefixCache(config.prefix_cache_bytes, full_kv_bytes_per_token(spec))

    def forward(self, requests: list[EncodedRequest], use_cache: bool = True) -> tuple[Forest, torch.Tensor]:
        """Answer states (A, H) of the forest of `requests`: cached blocks' K/V from the cache, the
        rest computed in chunks of at most prefill_chunk_tokens rows (whole segments), each given
        the K/V before it. Every segment sees the same inputs whichever way the rows are split, so
        the bits agree. use_cache=False computes everything and leaves the cache untouched."""
        cache = self.cache if use_cache else None
        forest = build_forest(requests, self.config.kv_block_tokens, cache)
        segments = forest.segments
        past = None
        if forest.cached_entries:  # per layer (cached rows, Hkv, D)
            k = torch.cat([e.k for e in forest.cached_entries], dim=1)
            v = torch.cat([e.v for e in forest.cached_entries], dim=1)
            past = list(zip(k.unbind(0), v.unbind(0)))
        chunks = self._chunks(list(range(len(forest.cached_entries), len(segments))), segments)
        hidden = []
        for n, chunk in enumerate(chunks):
            keep_kv = cache is not None or n + 1 < len(chunks)  # K/V for the cache or the next chunk
            h, past = self.model.run(forest, chunk, past, keep_kv)
            hidden.append(h)
        forest.stats.chunks = len(chunks)
        forest.stats.max_chunk_rows = max(sum(segments[i].length for i in c) for c in chunks)
        if cache is not None:
            self._remember(forest, past)
        return forest, torch.cat(hidden)

    def _chunks(self, computed: list[int], segments) -> list[list[int]]:
        limit = self.config.prefill_chunk_tokens
        chunks, rows = [[]], 0
        for i in computed:
            if limit and chunks[-1] and rows + segments[i].length > limit:
                chunks.append([])
                rows = 0
            chunks[-1].append(i)
            rows += segments[i].length
        return chunks

    def _remember(self, forest: Forest, kv) -> None:
        """Insert the computed root/trunk blocks and touch the cached ones, leaf first, so that a
        parent is always more recent than its children (LRU then evicts children first)."""
        cached = len(forest.cached_entries)
        for index in reversed(range(len(forest.segments))):
            seg = forest.segments[index]
            if seg.cache_key is None:
                continue
            if index < cached:
                self.cache.insert(seg.cache_key, forest.cached_entries[index])  # present: a touch
                continue
            rows = slice(seg.start, seg.start + seg.length)
            k = torch.stack([layer_k[rows] for layer_k, _ in kv])  # (layers, n, Hkv, D)
            v = torch.stack([layer_v[rows] for _, layer_v in kv])
            tokens = tuple(forest.token_ids[rows].tolist())
            self.cache.insert(seg.cache_key, CacheEntry(tokens, k, v))
