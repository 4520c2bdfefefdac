"""`prism export-repository OUT`: a model repository any Triton server loads as it is.

`prism serve` renders model_repository/ and then supplies, from outside, what the models need:
Python packages on PATH, libpython on LD_LIBRARY_PATH, a stub for its interpreter. An export puts
all of that inside the folder, so it can be moved, synced to a model store and loaded by a Triton
fleet with `tritonserver --model-repository=OUT`:

    OUT/prism_export.json            what it is: Prism and checkpoint versions, the options it was rendered with
    OUT/prism_env.tar.gz             the Python execution environment the three Python models share
                                     (with --environment directory: unpacked in OUT/prism_decision/python_env/,
                                     which the servers use in place instead of unpacking it on every start)
    OUT/prism/                       the ensemble (the public model), unchanged
    OUT/prism_<step>/config.pbtxt    rendered as `prism serve` renders it, plus EXECUTION_ENV_PATH
    OUT/prism_<step>/triton_python_backend_stub   built for the environment's Python
    OUT/prism_<step>/prism_backend/, kernels/     the engine; the stub puts the model's folder on sys.path
                                     (kernels/cpu/lib/: the exact CPU GEMMs, built here, for servers without g++)
    OUT/prism_<step>/prism_client/   the engine's self-check digests bits with its determinism.py
    OUT/prism_<step>/1/              model.py (and tasks.json, the task registry), as in model_repository/
    OUT/prism_decision/checkpoint/   the weights, and prism-calibration/: their calibration for the exported
                                     precision (GPTQ's integers ...), so the fleet's servers start without
                                     calibrating and all serve the same integers (engine/calibration.py)

Every path inside is relative: model_dir resolves against the model's own folder (EngineConfig),
EXECUTION_ENV_PATH against $$TRITON_MODEL_DIRECTORY (the Python backend substitutes it). Triton
loads only the folders at the top, so the two files there are never taken for models.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kernels
from kernels.cpu import exact_gemm
from prism_backend.config import ConfigError, EngineConfig
from prism_backend.engine.calibration import file_sha256, record_exported_bits, ship
from prism_backend.serving.decision_step import DecisionStep
from prism_backend.serving.steps import model_parameters

from .execution_env import DISTRIBUTION, packed_environment, python_version
from .server import (ENGINE_MODELS, EXPORT_ENVIRONMENTS, MODEL_ENVIRONMENT, REPO_ROOT, ServerOptions, _package_dir,
                     render_model_repository, set_parameter, triton_install)

MANIFEST = "prism_export.json"
ENV_ARCHIVE = "prism_env.tar.gz"
DECISION_MODEL = ENGINE_MODELS[1]  # prism_decision: the model whose build reads the calibration
CHECKPOINT = Path(DECISION_MODEL) / "checkpoint"
# How the execution environment is exported (EXPORT_ENVIRONMENTS): one archive, which the Python backend
# unpacks into /tmp on every server start (and deletes on every stop), or that archive unpacked once,
# here, into ENV_DIRECTORY and used in place (a folder inside a model that is not a version number is
# no model: Triton passes it over)
ENV_DIRECTORY = Path(DECISION_MODEL) / "python_env"
# What the model.py files import, besides the environment (prism_client: the engine's self-check
# digests with prism_client/determinism.py, a leaf module of numpy alone)
ENGINE_PACKAGES = ("prism_backend", "prism_client", "kernels")
# where exact_gemm looks for its built library, relative to a model's folder: kernels/cpu/lib
LIBRARY_FOLDER = Path("kernels") / exact_gemm.PACKAGE_LIB.relative_to(Path(kernels.__file__).parent)
STUB = "triton_python_backend_stub"
PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


def export_options(options: ServerOptions) -> ServerOptions:
    """`prism serve` gives each process its share of this machine's cores; an export runs on machines
    not known yet, so unless num_threads is given it is 0 (torch's default: the target's cores)."""
    return dataclasses.replace(options, extra_parameters={"num_threads": "0", **options.extra_parameters})


def export_repository(options: ServerOptions, out: Path, env_cache: Path | None = None, log=print,
                      environment: str = "archive") -> Path:
    """Write the self-contained repository to `out` (which must not exist yet) and return it.
    environment: one of EXPORT_ENVIRONMENTS."""
    options = export_options(options)
    options.validate()
    if environment not in EXPORT_ENVIRONMENTS:
        raise ConfigError(f"environment must be one of {', '.join(EXPORT_ENVIRONMENTS)}, not {environment!r}")
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} already exists; export into a new folder")
    staging = out.with_name(out.name + ".partial")  # renamed at the end: never a half-written export
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _write(options, staging, env_cache, log, environment)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(out)
    return out


def _write(options: ServerOptions, staging: Path, env_cache: Path | None, log, environment: str) -> None:
    render_model_repository(options, staging)
    _copy_checkpoint(Path(options.model_dir), staging / CHECKPOINT)
    for name in ENGINE_MODELS:
        relative = os.path.relpath(staging / CHECKPOINT, staging / name)
        _edit_config(staging / name, lambda text: set_parameter(text, "model_dir", relative))
    stub = triton_install()["stub"]
    library = exact_gemm.built_library()
    if library is None:
        log(f"note: the export carries no exact GEMM library ({exact_gemm.why_not()}); its servers build it or use the float route")
    env_path = f"$$TRITON_MODEL_DIRECTORY/../{ENV_ARCHIVE if environment == 'archive' else ENV_DIRECTORY}"
    for model in _python_models(staging):
        _edit_config(model, lambda text: set_parameter(text, "EXECUTION_ENV_PATH", env_path))
        shutil.copy2(stub, model / STUB)
        for package in ENGINE_PACKAGES:
            shutil.copytree(_package_dir(package), model / package, ignore=shutil.ignore_patterns("__pycache__", "lib"))
        if library is not None:
            (model / LIBRARY_FOLDER).mkdir()
            shutil.copy2(library, model / LIBRARY_FOLDER / library.name)
    # the exported copy, whatever PRISM_MODEL_DIR says in this process (it overrides model_dir for servers)
    config = dataclasses.replace(_check_parameters(staging), model_dir=(staging / CHECKPOINT).resolve())
    shipped = ship(config)
    if shipped:
        _record_bits(config)
        log(f"shipped the calibration with the checkpoint: {', '.join(p.name for p in shipped)}")
    archive = packed_environment(MODEL_ENVIRONMENT, env_cache, log=log)
    if environment == "archive":
        _link_or_copy(archive, staging / ENV_ARCHIVE)
    else:
        _unpack(archive, staging / ENV_DIRECTORY)
    described = manifest(options, staging, environment)
    (staging / MANIFEST).write_text(json.dumps(described, indent=2, sort_keys=True) + "\n")


def _record_bits(config: EngineConfig) -> None:
    """The decision step built here from what was just shipped (so also a check that it loads), on
    one process (bits do not depend on tensor parallelism): its self-check's digests become the bits
    every server of the export checks itself against at start."""
    step = DecisionStep(dataclasses.replace(config, tp_size=1))
    try:
        if not step.self_check_ok:
            raise ConfigError(f"the engine's self-check failed on this machine: {'; '.join(step.self_check_problems)}")
        record_exported_bits(config, step.self_check_digests)
    finally:
        step.close()


def _edit_config(model: Path, edit) -> None:
    path = model / "config.pbtxt"
    path.write_text(edit(path.read_text()))


def _python_models(repository: Path) -> list[Path]:
    return sorted(p.parent for p in repository.glob("*/config.pbtxt") if 'backend: "python"' in p.read_text())


def _copy_checkpoint(model_dir: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not path.name.startswith("."):  # not .prism-converted and other markers
            shutil.copy2(path, target / path.name)


def _unpack(archive: Path, target: Path) -> None:
    """The archive unpacked as the Python backend unpacks it (pb_env.cc: the archive's tree, modes kept),
    by tar, which is several times faster than Python's tarfile on its 35,000 files."""
    target.mkdir(parents=True)
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(target)], check=True)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link to the cached archive where the filesystem allows (it is never written in place)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _check_parameters(repository: Path) -> EngineConfig:
    """Fail at export, not at load on the fleet, on a parameter the engine would reject; the decision
    model's engine configuration."""
    configs = {}
    for name in ENGINE_MODELS:
        text = (repository / name / "config.pbtxt").read_text()
        found = PARAMETER.findall(text)
        params = model_parameters({"parameters": {k: {"string_value": v} for k, v in found}})
        configs[name] = EngineConfig.from_parameters(params, base_dir=repository / name)
        if not (configs[name].model_dir / "config.json").exists():
            raise ConfigError(f"{name}: model_dir {configs[name].model_dir} holds no checkpoint")
    return configs[DECISION_MODEL]


def manifest(options: ServerOptions, repository: Path, environment: str = "archive") -> dict:
    checkpoint = repository / CHECKPOINT
    return {
        "prism_version": importlib.metadata.version(DISTRIBUTION),
        "prism_commit": _git(["rev-parse", "HEAD"]),
        "prism_files_modified_since_commit": bool(_git(["status", "--porcelain", "--untracked-files=no"])),
        "checkpoint": {
            "source": Path(options.model_dir).name,
            # prism-calibration/ too; the weights' hashes are ship()'s, not computed again
            "sha256": {str(p.relative_to(checkpoint)): file_sha256(p)
                       for p in sorted(checkpoint.rglob("*")) if p.is_file()},
        },
        "options": {"precision": options.precision, "instances": options.instances, "tp": options.tp,
                    "max_batch_size": options.max_batch_size, "parameters": options.extra_parameters,
                    "environment": environment},
        "python": python_version(),
        "stub_from": f"nvidia-pytriton=={importlib.metadata.version('nvidia-pytriton')}",
    }


def _git(args: list[str]) -> str | None:
    """Output of a git command in the checkout, or None where Prism was installed without one."""
    done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None
