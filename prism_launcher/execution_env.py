"""The packed Python execution environment an exported model repository ships (EXECUTION_ENV_PATH).

What Triton's Python backend does with it (read in python_backend r24.10 = Triton 2.51,
src/pb_env.cc and src/stub_launcher.cc): EXECUTION_ENV_PATH names a tar archive (plain or gzip)
or a directory; an archive is extracted once per server into /tmp/python_env_*/N, shared by every
model naming the same file; each stub then starts as
    bash -c "source <env>/bin/activate && exec env LD_LIBRARY_PATH=<env>/lib:$LD_LIBRARY_PATH <stub> ..."
So the environment must be a whole Python installation: its own interpreter and libpython in lib/
(the stub links libpython3.X by name, and the server's container has another Python or none), the
standard library, the engine's dependencies, and a bin/activate that works wherever it is extracted.

conda-pack makes exactly that from a conda environment, but conda packages cannot be installed on
the project's machines (PyPI only); venv-pack's archives hold no interpreter (a virtualenv points at
its base Python by absolute path). So this module builds the installation itself, from the running
interpreter's (an --enable-shared CPython) plus `pip install --prefix` of the runtime dependencies
pinned to the versions installed here, and packs it with fixed metadata. Building takes minutes and
a few GB, so the archive is cached by a key over everything that goes into it; the least recently
used archives go while the cache holds more than PRISM_ENV_CACHE_LIMIT (default 5G;
prism_backend/cache_eviction.py), and every export that finds its archive counts as a use.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from prism_backend import cache_eviction
from prism_backend.config import ConfigError
from prism_backend.paths import user_cache_dir

DISTRIBUTION = "prism-decisions"
# Requirements of the launcher and of `prism setup`, not of the models inside Triton.
LAUNCHER_ONLY = {"tritonclient", "nvidia-pytriton", "nvidia-cuda-runtime-cu12", "gguf", "accelerate"}
# Parts of the standard library no model imports: tests, GUIs, the static libpython, pip's bootstrap.
STDLIB_SKIP = ("site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
               "config-*", "__pycache__")
# Provided by the C library of any Linux the server runs on; every other library an interpreter
# module links (libssl, libffi, libsqlite3, ...) is copied into lib/.
GLIBC = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libutil|libresolv)\b")
FIXED_MTIME = 1767225600  # 2026-01-01: archive entries carry this, not the build time
ACTIVATE = """\
# Sourced by Triton's Python backend before it starts a stub. Relocatable: the backend extracts the
# environment to a temporary directory chosen at run time.
PRISM_ENV="$(cd "$(dirname "${{BASH_SOURCE[0]}}")/.." && pwd)"
export PATH="$PRISM_ENV/bin:${{PATH:-/usr/local/bin:/usr/bin:/bin}}"
export PYTHONHOME="$PRISM_ENV"
unset PYTHONPATH
# Processes the models start (tensor-parallel workers) need this installation's libpython too.
export LD_LIBRARY_PATH="$PRISM_ENV/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
export PRISM_PYTHON="$PRISM_ENV/bin/python{version}"
{model_environment}
"""


def runtime_requirements() -> list[str]:
    """Prism's own requirements minus the launcher's, each pinned to the version installed here, plus
    their dependencies pinned the same way, so the models run on the very packages `prism serve` uses."""
    from packaging.requirements import Requirement

    def needed(text: str) -> Requirement | None:  # None: an extra, or another platform's
        req = Requirement(text)
        return req if req.marker is None or req.marker.evaluate({"extra": ""}) else None

    direct = [r.name for r in map(needed, importlib.metadata.requires(DISTRIBUTION) or []) if r]
    pinned: dict[str, str] = {}
    todo = [n for n in direct if _canonical(n) not in LAUNCHER_ONLY]
    while todo:
        name = _canonical(todo.pop())
        if name in pinned:
            continue
        dist = importlib.metadata.distribution(name)
        pinned[name] = f"{name}=={dist.version}"
        todo += [r.name for r in map(needed, dist.requires or []) if r]
    return sorted(pinned.values())


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def environment_key(model_environment: dict[str, str]) -> str:
    """Changes when anything that goes into the archive changes: interpreter, packages, this builder."""
    h = hashlib.sha256()
    for part in (sys.version, *runtime_requirements(), Path(__file__).read_text(), repr(sorted(model_environment.items()))):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


LIMIT_VARIABLE, DEFAULT_LIMIT = "PRISM_ENV_CACHE_LIMIT", "5G"  # the cache's size (cache_eviction.py)
# packed_environment()'s names, and their use markers
ARCHIVE = re.compile(rf"\.?(prism-env-py[0-9.]+-[0-9a-f]{{16}}\.tar\.gz)(?:{re.escape(cache_eviction.USED_SUFFIX)})?")


def archive_key(name: str) -> str | None:
    """An archive of the cache and its use marker are one entry, keyed by the archive's name; None for any other file."""
    match = ARCHIVE.fullmatch(name)
    return match.group(1) if match else None


def default_cache_dir() -> Path:
    """Outside the checkout, so fresh clones (CI) on the same machine reuse the archive."""
    return user_cache_dir("execution-envs", "PRISM_ENV_CACHE") or Path(tempfile.gettempdir()) / "prism-execution-envs"


def packed_environment(model_environment: dict[str, str], cache_dir: Path | None = None, log=print) -> Path:
    """The cached archive for this interpreter and these packages; built first if missing."""
    cache_dir = Path(cache_dir or default_cache_dir())
    archive = cache_dir / f"prism-env-py{python_version()}-{environment_key(model_environment)}.tar.gz"
    max_bytes = cache_eviction.limit(LIMIT_VARIABLE, DEFAULT_LIMIT)  # a bad limit fails before building
    if archive.exists():
        cache_eviction.mark_used(archive)
        return archive
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=cache_dir) as build:
        prefix = Path(build) / "env"
        log(f"prism: building the execution environment in {prefix} (once; several minutes)")
        build_prefix(prefix, model_environment)
        log(f"prism: packing it into {archive}")
        partial = Path(build) / archive.name
        pack(prefix, partial)
        partial.rename(archive)  # atomic: a half-written archive is never found in the cache
    cache_eviction.evict(cache_dir, max_bytes, archive_key, keep=archive.name)
    return archive


def build_prefix(prefix: Path, model_environment: dict[str, str]) -> None:
    """A relocatable Python installation at `prefix`: interpreter, stdlib, runtime packages, activate."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise ConfigError("exporting needs a CPython built with --enable-shared (the stub links libpython)")
    version = python_version()
    libdir = Path(sysconfig.get_config_var("LIBDIR"))
    soname = sysconfig.get_config_var("INSTSONAME")  # libpython3.11.so.1.0
    stdlib = Path(sysconfig.get_paths()["stdlib"])  # the base installation's, also inside a venv
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib").mkdir()
    shutil.copy2(Path(sys.executable).resolve(), prefix / "bin" / f"python{version}")
    (prefix / "bin" / "python3").symlink_to(f"python{version}")
    shutil.copy2(libdir / soname, prefix / "lib" / soname)
    shutil.copytree(stdlib, prefix / "lib" / f"python{version}", ignore=shutil.ignore_patterns(*STDLIB_SKIP))
    _copy_linked_libraries(prefix, [prefix / "bin" / f"python{version}", prefix / "lib" / soname,
                                    *(prefix / "lib" / f"python{version}" / "lib-dynload").glob("*.so")])
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--prefix", str(prefix), "--ignore-installed", "--no-compile", "--no-warn-script-location",
                    *runtime_requirements()], check=True)
    for script in (prefix / "bin").iterdir():  # console scripts name this machine's interpreter path
        if script.name not in (f"python{version}", "python3"):
            script.unlink()
    exports = "\n".join(f'export {k}="{v}"' for k, v in sorted(model_environment.items()))
    (prefix / "bin" / "activate").write_text(ACTIVATE.format(version=version, model_environment=exports))
    # Bytecode checked by hash, not by the source's mtime: archive entries carry a fixed mtime, and
    # without .pyc files every server start would compile torch and transformers again.
    python = prefix / "bin" / f"python{version}"
    env = {"PYTHONHOME": str(prefix), "LD_LIBRARY_PATH": str(prefix / "lib"), "PATH": os.environ.get("PATH", "")}
    # `-s prefix`: the .pyc files record paths relative to the installation, not this build's temporary
    # folder, so two builds give the same bytes (imports put the real path back: _imp._fix_co_filename).
    # `-f`: also recompile what compileall's own imports just wrote with timestamps and absolute paths.
    # Not checked: a few packages ship files that are not Python 3 (templates, test data).
    subprocess.run([str(python), "-m", "compileall", "-q", "-f", "-j", "0", "--invalidation-mode", "unchecked-hash",
                    "-s", str(prefix), str(prefix / "lib" / f"python{version}")], env=env, stdout=subprocess.DEVNULL)
    # The installation must stand alone: nothing from this machine's Python on the path.
    done = subprocess.run([str(python), "-I", "-c", "import numpy, torch, transformers, tokenizers, safetensors, triton"],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the execution environment at {prefix} cannot import the engine's packages:\n{done.stderr}")


def _copy_linked_libraries(prefix: Path, elf_files: list[Path]) -> None:
    """Copy into prefix/lib every shared library these files link, except the C library's own."""
    lib = prefix / "lib"
    for path in elf_files:
        out = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
        for name, target in re.findall(r"^\s*(\S+) => (/\S+)", out, re.M):
            if not GLIBC.match(name) and not (lib / name).exists() and not Path(target).is_relative_to(prefix):
                shutil.copy2(Path(target).resolve(), lib / name)


def pack(prefix: Path, archive: Path) -> None:
    """tar.gz of `prefix` with sorted entries and fixed owners and times, so equal trees give equal bytes."""

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = FIXED_MTIME
        if info.isfile():
            info.mode = 0o755 if info.mode & 0o100 else 0o644
        elif info.isdir():
            info.mode = 0o755
        return info

    with open(archive, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=1) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for root, dirs, files in os.walk(prefix):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                path = Path(root) / name
                info = normalize(tar.gettarinfo(path, arcname=str(path.relative_to(prefix))))
                if info.isfile():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
