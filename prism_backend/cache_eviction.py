"""Prism's user caches stay within a size limit: the least recently used entries go first.

Two caches gain an entry for every code version and checkpoint, and nothing else ever removes one:
the calibration (engine/calibration.py: ~0.33 GB an entry for SmolLM2-135M -- GPTQ's integers and
the rotated vocabulary rows -- and several GB for a 7B model) and the packed execution environments
of exports (prism_launcher/execution_env.py: ~0.7 GB each). Like ccache's max_size, each cache has a
limit, read from its variable (a size: "10G", "500M", "1.5G", bytes; or "none"), and enforced
after every store: whole entries are removed, oldest use first, until the folder is within it.

An entry is every file whose name carries its key (a calibration's kinds with their lock, partial
and use-marker files). Its last use is the newest modification time among its files, and a hit
refreshes it by touching a marker beside the file found (mark_used), not the file itself: that may
be hard-linked into an exported repository, where Triton's Python backend takes a new modification
time of its environment archive for a new archive. So the entry a fleet starts from every day stays.
Never removed: the entry just stored (`keep`), and an entry whose lock a build holds, which is
computing it now. An entry a running server still maps (the rotated rows) stays readable to it
after its removal (the pages live until unmapped); a build that looks for it afterwards computes it
again -- the same bits, later.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError

NO_LIMIT = "none"
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
LOCK_SUFFIX, USED_SUFFIX = ".lock", ".used"


def parse_size(text: str, variable: str) -> int | None:
    """Bytes of a size such as "10G", "500M", "1.5GiB" or "123" (bytes), or None for "none" (no
    limit); anything else is a ConfigError naming `variable`."""
    text = text.strip()
    if text.lower() == NO_LIMIT:
        return None
    match = SIZE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{variable}={text!r} is not a size: give bytes with an optional K, M, G or T "
                          f"suffix (e.g. 10G), or {NO_LIMIT!r} for no limit")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def limit(variable: str, default: str) -> int | None:
    """The cache's limit in bytes (None: unlimited), from the environment variable `variable`, else `default`."""
    return parse_size(os.environ.get(variable) or default, variable)


def mark_used(path: Path) -> None:
    """A hit on the cache's file `path`: its entry's last use is now (the time of `.<name>.used`
    beside it). Nothing where the folder cannot be written (a read-only cache is read as it is)."""
    with contextlib.suppress(OSError):
        used_marker(Path(path)).touch()


def used_marker(path: Path) -> Path:
    return path.parent / f".{path.name}{USED_SUFFIX}"


@dataclass(frozen=True)
class Entry:
    key: str
    files: tuple[Path, ...]
    bytes: int
    last_use_ns: int  # the newest modification time among its files


def entries(folder: Path, key_of: Callable[[str], str | None]) -> list[Entry]:
    """The entries of `folder` -- its files grouped by key_of(name), files it maps to None left out
    -- least recently used first."""
    found: dict[str, list[tuple[Path, os.stat_result]]] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        key = key_of(name)
        if key is None:
            continue
        path = Path(folder) / name
        with contextlib.suppress(OSError):
            stat = path.stat()
            if path.is_file():
                found.setdefault(key, []).append((path, stat))
    made = [Entry(key, tuple(path for path, _ in files), sum(stat.st_size for _, stat in files),
                  max(stat.st_mtime_ns for _, stat in files)) for key, files in found.items()]
    return sorted(made, key=lambda e: (e.last_use_ns, e.key))


def evict(folder: Path, max_bytes: int | None, key_of: Callable[[str], str | None],
          keep: str | None = None) -> list[str]:
    """Remove whole entries of `folder` (entries()), least recently used first, until they total
    at most `max_bytes`; never `keep` nor an entry whose lock (a file of it ending in .lock) another
    open file holds. The keys removed, oldest first."""
    if max_bytes is None:
        return []
    found = entries(folder, key_of)
    total = sum(e.bytes for e in found)
    removed = []
    for entry in found:
        if total <= max_bytes:
            break
        if entry.key == keep:
            continue
        with _unless_locked([path for path in entry.files if path.name.endswith(LOCK_SUFFIX)]) as free:
            if not free:
                continue
            for path in entry.files:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            total -= entry.bytes
            removed.append(entry.key)
    return removed


@contextlib.contextmanager
def _unless_locked(locks: list[Path]):
    """Yields True holding every lock in `locks` (none held by anyone else), else False holding none."""
    held = []
    try:
        for lock in locks:
            try:
                handle = open(lock, "a")
            except OSError:
                continue  # cannot be opened here (a read-only folder): this process cannot lock it
            held.append(handle)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
        yield True
    finally:
        for handle in held:
            handle.close()
