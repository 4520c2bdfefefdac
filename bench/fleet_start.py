"""Start to ready of an exported repository on a new server (a fleet's pod): empty caches every time.

    .venv/bin/python bench/fleet_start.py [--precision int8] [--rounds 2]

Exports the repository twice (`prism export-repository`: the environment as the archive, and with
`--environment directory`), copies the archive export without its shipped calibration (what every
export was before 2026-12-07), then serves each as it is (`prism serve --repository`, the launcher's
tritonserver) with empty calibration and kernel caches, as a new machine or container has them, and
times launch to every model ready: the three variants in turn, `--rounds` times. Each start also
says whether it wrote anything to its calibration cache (a start that calibrated did). Writes
bench/results/fleet_start.md. docs/deploy.md explains what is shipped and why.
"""
from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import tempfile
from pathlib import Path

from side_by_side import prism_startup_seconds
from workloads import write_result

from kernels.cpu.features import machine
from prism_backend.engine.calibration import SHIPPED
from prism_launcher.export import CHECKPOINT, export_repository
from prism_launcher.server import ServerOptions

VARIANTS = ("archive, calibration not shipped", "archive, calibration shipped", "directory, calibration shipped")


def exports(precision: str, folder: Path) -> dict[str, Path]:
    """The three repositories of VARIANTS, written under `folder`."""
    archive = export_repository(ServerOptions(precision=precision), folder / "archive", log=lambda m: None)
    directory = export_repository(ServerOptions(precision=precision), folder / "directory", log=lambda m: None,
                                  environment="directory")
    unshipped = folder / "unshipped"
    shutil.copytree(archive, unshipped, copy_function=shutil.copy2)
    shutil.rmtree(unshipped / CHECKPOINT / SHIPPED, ignore_errors=True)
    return dict(zip(VARIANTS, (unshipped, archive, directory)))


def fresh_start(repository: Path, scratch: Path) -> tuple[float, bool]:
    """(seconds from launch to ready, whether the start wrote to its empty calibration cache)."""
    with tempfile.TemporaryDirectory(dir=scratch) as caches:
        seconds = prism_startup_seconds(ServerOptions(repository=repository), Path(caches))
        calibrated = any(Path(caches, "calibration").glob("*.safetensors"))
    return seconds, calibrated


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prism-fleet-start-") as scratch:
        repositories = exports(args.precision, Path(scratch))
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        calibrated: dict[str, set[bool]] = {v: set() for v in VARIANTS}
        for round_ in range(args.rounds):
            for variant, repository in repositories.items():
                seconds, wrote = fresh_start(repository, Path(scratch))
                times[variant].append(seconds)
                calibrated[variant].add(wrote)
                print(f"round {round_ + 1}, {variant}: {seconds:.1f} s to ready, calibrated: {wrote}", flush=True)
    lines = [f"# An exported repository on a new server ({args.precision}, empty caches)", "",
             f"{datetime.date.today()}, {machine()}; `.venv/bin/python bench/fleet_start.py --precision "
             f"{args.precision} --rounds {args.rounds}`: launch to every model ready (`prism serve --repository`), "
             "the variants in turn, each start with empty calibration and kernel caches.", "",
             "| export | start to ready, each round | median | calibrated at start |", "|---|---|---|---|",
             *(f"| {v} | {' / '.join(f'{t:.1f} s' for t in times[v])} | {statistics.median(times[v]):.1f} s | "
               f"{'yes' if True in calibrated[v] else 'no'} |" for v in VARIANTS)]
    write_result(f"fleet_start_{args.precision}.md", lines)


if __name__ == "__main__":
    main()
