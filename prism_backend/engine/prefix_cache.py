"""Prefix KV cache: keys and values of shared prefixes kept across batches, under a byte budget.

Entries are prefix *blocks*: the system prompt and the material are cut into blocks of
`kv_block_tokens` (forest_builder.py), and each block is keyed by a content hash chained to its parent's,
    key(block) = sha256(key(parent) + its token ids),
so a key names the whole prefix up to and including the block. A hit returns the block's K/V for
every layer, exactly as computed before (fp32, bit-for-bit), so reusing it gives the same
probabilities as recomputing it. The stored token ids are compared on every hit: a hash collision
can never hand one text the KV of another.

Memory: entries are evicted least-recently-used first until the bytes held fit the budget. Chains
are touched and inserted leaf first, so a parent is always more recent than its children and
children go before their parents. Thread-safe: concurrent batches may read and insert the same prefix.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

ROOT_KEY = b""  # the parent key of a tree's first block


def block_key(parent_key: bytes, tokens: tuple[int, ...]) -> bytes:
    h = hashlib.sha256(parent_key)
    h.update(len(tokens).to_bytes(4, "little"))
    for t in tokens:
        h.update(t.to_bytes(4, "little"))
    return h.digest()


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]
    k: torch.Tensor  # (layers, n, Hkv, D) float32
    v: torch.Tensor  # (layers, n, Hkv, D) float32

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass
class CacheStats:
    tokens_looked_up: int = 0
    tokens_reused: int = 0
    insertions: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.tokens_reused / self.tokens_looked_up if self.tokens_looked_up else 0.0


class PrefixCache:
    def __init__(self, budget_bytes: int, bytes_per_token: int | None = None):
        """bytes_per_token: what a block is charged per token; with tensor parallelism the full
        model's K/V size, so that every rank (holding a different share of the heads) makes the
        same eviction decisions. None: the entry's own size."""
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self.bytes_held = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup_chain(self, blocks: list[tuple[bytes, tuple[int, ...]]]) -> list[CacheEntry]:
        """blocks: (key, tokens) of a prefix, root first -> the entries of its longest cached head."""
        found = []
        with self._lock:
            for key, tokens in blocks:
                entry = self._entries.get(key)
                if entry is None or entry.tokens != tokens:
                    break
                found.append(entry)
            for key, _ in reversed(blocks[: len(found)]):  # leaf first: parents end up most recent
                self._entries.move_to_end(key)
            self.stats.tokens_looked_up += sum(len(t) for _, t in blocks)
            self.stats.tokens_reused += sum(len(e.tokens) for e in found)
        return found

    def _cost(self, entry: CacheEntry) -> int:
        return entry.nbytes if self.bytes_per_token is None else len(entry.tokens) * self.bytes_per_token

    def insert(self, key: bytes, entry: CacheEntry) -> None:
        if self._cost(entry) > self.budget_bytes:
            return  # would evict everything and still not fit
        with self._lock:
            if key in self._entries:  # a touch, or a concurrent batch computed the same block: same bits
                self._entries.move_to_end(key)
                return
            self._entries[key] = entry
            self.bytes_held += self._cost(entry)
            self.stats.insertions += 1
            while self.bytes_held > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes_held -= self._cost(old)
                self.stats.evictions += 1
