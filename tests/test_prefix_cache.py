"""Prefix KV cache and chunked prefill: bit-identical to recomputing, bounded memory, thread-safe."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from prism_backend.engine.prefix_cache import CacheEntry, PrefixCache, block_key
from prism_backend.serving.pipeline import DecisionPipeline

from helpers import REGISTRY, SAMPLE_TICKET

QUESTIONS = ["team", "severity", "reply_time"]


def settings(pipeline, cache_bytes: int = 0, chunk: int = 0) -> DecisionPipeline:
    """A pipeline with the weights of `pipeline` (the session's int8 one: no second load), a fresh
    cache of `cache_bytes` (0: none) and chunks of `chunk` rows (0: no limit)."""
    config = pipeline.engine.config.replace(prefix_cache_bytes=cache_bytes, prefill_chunk_tokens=chunk)
    return DecisionPipeline(config, REGISTRY, share_weights_with=pipeline)


def bits(results) -> list[bytes]:
    return [np.array(list(d["probabilities"].values()), np.float32).tobytes() for r in results for d in r]


def ticket(i: int, words: int = 120) -> str:
    return f"Ticket {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(words))


def test_cached_kv_gives_the_same_bits_and_a_smaller_forest(int8_pipeline):
    batch = [{"material": SAMPLE_TICKET, "tasks": QUESTIONS}, {"material": ticket(1), "tasks": ["team"]}]
    plain, plain_stats = settings(int8_pipeline).decide_many(batch)
    cached = settings(int8_pipeline, cache_bytes=1 << 30)
    first, first_stats = cached.decide_many(batch)
    again, again_stats = cached.decide_many(batch)
    assert len(cached.engine.cache) > 0 and cached.engine.cache.bytes_held > 0
    assert bits(plain) == bits(first) == bits(again)
    assert first_stats.tokens_cached == 0 and first_stats.tokens_computed == plain_stats.tokens_computed
    # the second time only the questions are computed: every root and trunk block came from the cache
    assert again_stats.tokens_cached == plain_stats.tokens_computed - again_stats.tokens_computed
    assert again_stats.tokens_computed < plain_stats.tokens_computed / 3


def test_new_question_about_a_seen_ticket_reuses_its_blocks(int8_pipeline):
    plain, _ = settings(int8_pipeline).decide_many([{"material": SAMPLE_TICKET, "tasks": ["severity@1"]}])
    cached = settings(int8_pipeline, cache_bytes=1 << 30)
    cached.decide_many([{"material": SAMPLE_TICKET, "tasks": ["team"]}])
    hit, stats = cached.decide_many([{"material": SAMPLE_TICKET, "tasks": ["severity@1"]}])
    assert stats.tokens_cached > 0 and cached.engine.cache.stats.hit_rate > 0
    assert bits(hit) == bits(plain)


def test_chunked_prefill_is_bit_identical_and_bounded(int8_pipeline):
    batch = [{"material": ticket(i, words=300), "tasks": QUESTIONS[: 1 + i % 3]} for i in range(3)]
    whole, whole_stats = settings(int8_pipeline).decide_many(batch)
    chunked, chunked_stats = settings(int8_pipeline, chunk=128).decide_many(batch)
    assert bits(chunked) == bits(whole)
    assert whole_stats.chunks == 1 and chunked_stats.chunks > 5
    assert chunked_stats.max_chunk_rows <= 128 < whole_stats.max_chunk_rows


def test_eviction_keeps_the_cache_under_its_budget(int8_pipeline):
    spec = int8_pipeline.engine.spec
    token_bytes = spec.num_layers * 2 * spec.kv_dim * 4  # K and V, float32
    budget = 768 * token_bytes  # the K/V of 768 tokens; each ticket is ~420 tokens, ~390 of them its own
    stream = [{"material": ticket(100 + i), "tasks": ["team"]} for i in range(6)]
    uncached = settings(int8_pipeline)
    plain = [uncached.decide_many([r])[0] for r in stream]
    pipeline = settings(int8_pipeline, cache_bytes=budget)
    cache = pipeline.engine.cache
    cached = []
    for r in stream:
        cached.append(pipeline.decide_many([r])[0])
        assert cache.bytes_held <= budget
    assert cache.stats.evictions > 0 and cache.stats.insertions > len(cache)
    # the most recent ticket is still (partly) cached; an early one was evicted
    _, recent = pipeline.decide_many([stream[-1]])
    _, early = pipeline.decide_many([stream[0]])
    assert recent.tokens_cached > 0 and early.tokens_cached < recent.tokens_cached
    assert [bits(p) for p in plain] == [bits(c) for c in cached]


def test_concurrent_batches_read_and_insert_the_same_prefix(int8_pipeline):
    requests = [{"material": ticket(200), "tasks": [q]} for q in QUESTIONS] * 2
    uncached = settings(int8_pipeline)
    expected = [bits(uncached.decide_many([r])[0]) for r in requests]
    pipeline = settings(int8_pipeline, cache_bytes=1 << 30)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: bits(pipeline.decide_many([r])[0]), requests))
    held = sum(e.nbytes for e in pipeline.engine.cache._entries.values())
    assert pipeline.engine.cache.bytes_held == held  # no block counted twice
    assert got == expected


def test_material_up_to_the_full_context(tiny_model_dir):
    """A tiny Qwen3 with a 2,048-token context, material filling ~1,950 of it, prefilled in chunks
    of 512 rows: valid probabilities, bit-identical to one unchunked pass. (The embedded model's
    8,192-token context works the same way; it takes ~40 s per pass on 2 cores, too slow for CI.)"""
    from prism_backend.config import EngineConfig

    config = EngineConfig(model_dir=tiny_model_dir("qwen3"), precision="int8", prefix_cache_bytes=0)
    pipeline = DecisionPipeline(config, REGISTRY)
    assert pipeline.engine.spec.max_context == 2048
    request = [{"material": " ".join(["the cat sat on the mat"] * 315), "tasks": ["team"]}]  # 6 tokens each
    (chunked,), stats = settings(pipeline, chunk=512).decide_many(request)
    assert not isinstance(chunked, Exception), chunked
    assert stats.tokens_computed > 1900 and stats.max_chunk_rows <= 512 and stats.chunks >= 4
    p = np.array(list(chunked[0]["probabilities"].values()))
    assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-5
    (whole,), _ = settings(pipeline).decide_many(request)
    assert bits([whole]) == bits([chunked])
    too_long = [{"material": " ".join(["the cat sat on the mat"] * 345), "tasks": ["team"]}]
    (error,), _ = pipeline.decide_many(too_long)
    assert "the model's context is 2048 tokens (material too long)" in str(error)


# ---------------------------------------------------------------------------- the cache on its own

def _entry(tokens, size=4):
    t = torch.zeros(1, len(tokens), 1, size)
    return CacheEntry(tuple(tokens), t, t.clone())


def test_lru_evicts_children_before_their_parents():
    cache = PrefixCache(budget_bytes=3 * _entry((1, 2)).nbytes)
    root = block_key(b"", (1, 2))
    child = block_key(root, (3, 4))
    cache.insert(child, _entry((3, 4)))  # leaf first, as the engine does
    cache.insert(root, _entry((1, 2)))
    other = block_key(b"", (5, 6))
    cache.insert(other, _entry((5, 6)))
    assert [len(e) for e in [cache.lookup_chain([(root, (1, 2)), (child, (3, 4))])]] == [2]
    cache.insert(block_key(b"", (7, 8)), _entry((7, 8)))  # over budget: the LRU block goes
    assert cache.stats.evictions == 1 and len(cache) == 3
    assert len(cache.lookup_chain([(root, (1, 2)), (child, (3, 4))])) == 2  # touched: kept
    assert cache.lookup_chain([(other, (5, 6))]) == []


def test_a_key_collision_never_returns_other_tokens():
    cache = PrefixCache(budget_bytes=1 << 20)
    key = block_key(b"", (1, 2))
    cache.insert(key, _entry((1, 2)))
    assert cache.lookup_chain([(key, (9, 9))]) == []  # same key, different text: a miss
    assert len(cache.lookup_chain([(key, (1, 2))])) == 1


def test_an_entry_over_the_budget_is_not_kept():
    cache = PrefixCache(budget_bytes=10)
    cache.insert(b"k", _entry((1, 2, 3)))
    assert len(cache) == 0 and cache.bytes_held == 0


@pytest.mark.parametrize("field,value,message", [
    ("prefix_cache_bytes", -1, "prefix_cache_bytes must be >= 0"),
    ("prefill_chunk_tokens", 8, "at least kv_block_tokens"),
    ("kv_block_tokens", 0, "kv_block_tokens must be >= 1"),
])
def test_cache_config_is_validated(fp32_config, field, value, message):
    from prism_backend.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        fp32_config.replace(**{field: value})
