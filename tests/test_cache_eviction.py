"""Prism's user caches stay within their limits (prism_backend/cache_eviction.py): the least recently
used entries go first, whole; never the entry just stored nor one a build is computing; a hit counts
as a use; and both caches -- the calibration's and the exported execution environments' -- evict
through their real store paths."""
import fcntl
import os
import tarfile

import pytest
import torch

from prism_backend import cache_eviction
from prism_backend.config import ConfigError
from prism_backend.engine import calibration
from prism_launcher import cli, execution_env

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("text, size", [("10G", 10 * GiB), ("500M", 500 * MiB), ("1.5GiB", GiB + GiB // 2),
                                        ("64k", 64 << 10), ("123", 123), ("2 TB", 2 << 40), ("none", None),
                                        ("None", None)])
def test_sizes(text, size):
    assert cache_eviction.parse_size(text, "X") == size


@pytest.mark.parametrize("text", ["", "ten", "10Q", "-1G", "1e9"])
def test_a_bad_size_names_its_variable(text):
    with pytest.raises(ConfigError, match="PRISM_X_LIMIT"):
        cache_eviction.parse_size(text, "PRISM_X_LIMIT")


def write_entry(folder, key, sizes, age_s, *, lock=False):
    """Files KEY-<i>.bin of `sizes` bytes, last modified `age_s` ago; and a lock file if asked."""
    folder.mkdir(exist_ok=True)
    names = [f"{key}-{i}.bin" for i in range(len(sizes))] + ([f".{key}.lock"] if lock else [])
    for name, size in zip(names, [*sizes, 0]):
        (folder / name).write_bytes(b"x" * size)
        when = (folder / name).stat().st_mtime - age_s
        os.utime(folder / name, (when, when))
    return names


def key_of(name):
    """The test's entries: a file named KEY-... or .KEY... belongs to KEY (a one-letter key)."""
    name = name.lstrip(".")
    return name[0] if name[:1] in "abcdef" and name[1:2] in ("-", ".") else None


def test_least_recently_used_entries_go_first_until_within_the_limit(tmp_path):
    write_entry(tmp_path, "a", [300, 100], age_s=400)  # oldest
    write_entry(tmp_path, "b", [400], age_s=300)
    write_entry(tmp_path, "c", [200, 200], age_s=200)
    write_entry(tmp_path, "d", [100], age_s=100)  # newest
    (tmp_path / "unrelated.txt").write_bytes(b"y" * 10_000)  # not the cache's: neither counted nor removed
    assert cache_eviction.evict(tmp_path, 800, key_of) == ["a", "b"]  # 1500 -> 1100 -> 500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c-0.bin", "c-1.bin", "d-0.bin", "unrelated.txt"]
    assert cache_eviction.evict(tmp_path, 800, key_of) == []  # within the limit: nothing more goes
    assert cache_eviction.evict(tmp_path, None, key_of) == []


def test_the_entry_just_stored_stays_even_alone_above_the_limit(tmp_path):
    write_entry(tmp_path, "a", [500], age_s=100)
    write_entry(tmp_path, "b", [900], age_s=300)  # the oldest, but just stored by this process
    assert cache_eviction.evict(tmp_path, 100, key_of, keep="b") == ["a"]
    assert [p.name for p in tmp_path.iterdir()] == ["b-0.bin"]


def test_an_entry_whose_lock_is_held_stays(tmp_path):
    """A build holding an entry's lock is computing it (calibration.one_at_a_time): not removed."""
    write_entry(tmp_path, "a", [500], age_s=300, lock=True)
    write_entry(tmp_path, "b", [500], age_s=200)
    with open(tmp_path / ".a.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert cache_eviction.evict(tmp_path, 100, key_of) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.lock", "a-0.bin"]
    assert cache_eviction.evict(tmp_path, 100, key_of) == ["a"]  # released: it goes, its lock with it
    assert list(tmp_path.iterdir()) == []


def test_a_hit_makes_an_entry_the_most_recently_used(tmp_path):
    write_entry(tmp_path, "a", [500], age_s=300)
    write_entry(tmp_path, "b", [500], age_s=200)
    cache_eviction.mark_used(tmp_path / "a-0.bin")
    assert (tmp_path / ".a-0.bin.used").exists()
    assert cache_eviction.evict(tmp_path, 600, key_of) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a-0.bin.used", "a-0.bin"]


def test_a_hit_leaves_the_file_itself_untouched(tmp_path):
    """An exported repository hard-links the cached environment archive, and Triton's Python backend
    reads a new modification time of it as a new archive: the use is recorded beside it."""
    write_entry(tmp_path, "a", [10], age_s=300)
    before = (tmp_path / "a-0.bin").stat().st_mtime_ns
    cache_eviction.mark_used(tmp_path / "a-0.bin")
    assert (tmp_path / "a-0.bin").stat().st_mtime_ns == before


# ---- the calibration cache, through calibration.store() and the build's look-ups ------------------------------

def test_calibration_entries_are_evicted_by_the_store_of_a_new_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(tmp_path))
    tensors = {"w": torch.zeros(64 * 1024, dtype=torch.float32)}  # 256 KiB a file
    keys = [f"{i:x}" * calibration.KEY_LENGTH for i in range(3)]
    for age, key in zip((300, 200), keys):
        for kind in (calibration.GPTQ, calibration.ROWS):
            stored = calibration.store(tmp_path / f"{key}{kind}.safetensors", tensors, raw=True)
            os.utime(stored, (stored.stat().st_mtime - age,) * 2)
    (tmp_path / f".{keys[0]}{calibration.GPTQ}.safetensors.lock").touch()
    os.utime(tmp_path / f".{keys[0]}{calibration.GPTQ}.safetensors.lock", (0, 0))
    monkeypatch.setenv(calibration.LIMIT_VARIABLE, "1.2M")  # two entries of ~0.5 MiB fit, three do not
    calibration.store(tmp_path / f"{keys[2]}{calibration.GPTQ}.safetensors", tensors, raw=True)
    assert sorted({calibration.entry_key(p.name) for p in tmp_path.iterdir()}) == sorted(keys[1:])
    monkeypatch.setenv(calibration.LIMIT_VARIABLE, "none")
    calibration.store(tmp_path / f"{keys[0]}{calibration.GPTQ}.safetensors", tensors, raw=True)
    assert len({calibration.entry_key(p.name) for p in tmp_path.iterdir()}) == 3


def test_a_calibration_hit_counts_as_a_use(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(tmp_path))
    model = tiny_model_dir("llama3")
    made = []

    def compute():
        made.append(1)
        return {"w": torch.arange(4.0)}

    calibration._load_or_compute(model, calibration.GPTQ, compute, raw=True)
    stored = calibration.entry(model, calibration.GPTQ)
    assert made == [1] and not cache_eviction.used_marker(stored).exists()
    calibration._load_or_compute(model, calibration.GPTQ, compute, raw=True)
    assert made == [1] and cache_eviction.used_marker(stored).exists()
    assert calibration.entry_key(cache_eviction.used_marker(stored).name) == stored.name[:calibration.KEY_LENGTH]


def test_a_bad_calibration_limit_fails_before_calibrating(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(tmp_path))
    monkeypatch.setenv(calibration.LIMIT_VARIABLE, "lots")
    with pytest.raises(ConfigError, match=calibration.LIMIT_VARIABLE):
        calibration.entry(tiny_model_dir("llama3"), calibration.GPTQ)


# ---- the execution environments' cache, through packed_environment() --------------------------------

def test_building_an_environment_evicts_the_least_recently_used_archives(tmp_path, monkeypatch):
    """The build itself (minutes, GBs) replaced by a small tree; packing, naming, lookup and eviction real."""
    def small_prefix(prefix, model_environment):
        (prefix / "bin").mkdir(parents=True)
        (prefix / "bin" / "activate").write_bytes(os.urandom(200_000))  # incompressible: ~200 KB archives

    monkeypatch.setattr(execution_env, "build_prefix", small_prefix)
    monkeypatch.setenv(execution_env.LIMIT_VARIABLE, "500K")
    first = execution_env.packed_environment({"A": "1"}, tmp_path, log=lambda _: None)
    second = execution_env.packed_environment({"A": "2"}, tmp_path, log=lambda _: None)
    assert first.exists() and second.exists() and tarfile.is_tarfile(first)
    for age, archive in ((300, first), (200, second)):
        os.utime(archive, (archive.stat().st_mtime - age,) * 2)
    assert execution_env.packed_environment({"A": "1"}, tmp_path, log=lambda _: None) == first  # a hit: a use
    third = execution_env.packed_environment({"A": "3"}, tmp_path, log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, f".{first.name}.used", third.name])
    monkeypatch.setenv(execution_env.LIMIT_VARIABLE, "half")
    with pytest.raises(ConfigError, match=execution_env.LIMIT_VARIABLE):
        execution_env.packed_environment({"A": "4"}, tmp_path, log=lambda _: None)


# ---- `prism cache` ----------------------------------------------------------------------------------

def test_prism_cache_lists_each_cache_and_evicts_on_request(tmp_path, monkeypatch, capsys):
    calibration_dir, env_dir = tmp_path / "calibration", tmp_path / "envs"
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(calibration_dir))
    monkeypatch.setenv("PRISM_ENV_CACHE", str(env_dir))
    old, new = "0" * calibration.KEY_LENGTH, "1" * calibration.KEY_LENGTH
    calibration_dir.mkdir()
    for age, key in ((300, old), (100, new)):
        for kind in (calibration.GPTQ, calibration.ROWS):
            path = calibration_dir / f"{key}{kind}.safetensors"
            path.write_bytes(b"x" * (3 << 20))
            os.utime(path, (path.stat().st_mtime - age,) * 2)
    archive = env_dir / f"prism-env-py3.11-{'a' * 16}.tar.gz"
    env_dir.mkdir()
    archive.write_bytes(b"y" * (1 << 20))
    monkeypatch.setenv(calibration.LIMIT_VARIABLE, "8M")

    assert cli.main(["cache"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0] == (f"calibration: {calibration_dir}: 0.01 GiB in 2 entries, limit 0.01 GiB "
                         f"({calibration.LIMIT_VARIABLE})")
    assert [line.split()[:3] for line in listed[1:3]] == [[old, "6.0", "MiB"], [new, "6.0", "MiB"]]  # oldest first
    assert listed[3].startswith(f"execution environments: {env_dir}: 0.00 GiB in 1 entries, limit 5.00 GiB")
    assert listed[4].split()[:3] == [archive.name, "1.0", "MiB"]
    assert len(list(calibration_dir.iterdir())) == 4  # listing removes nothing

    assert cli.main(["cache", "--evict"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"prism: removed the calibration entry {old}"
    assert sorted(p.name for p in calibration_dir.iterdir()) == [f"{new}{calibration.GPTQ}.safetensors",
                                                                  f"{new}{calibration.ROWS}.safetensors"]
    assert archive.exists()
