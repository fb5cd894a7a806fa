"""What the cluster launchers (``slurm``, ``ray``, ``local-image``) share: the image reference, the job's argv and
environment.

The job (``job.json``) is the plan's miles launch (:func:`trainer.compose.render.render`: ``argv.json`` and
``env.json``, the same as ``command.sh``) unless ``launcher.job`` names another command (a probe-only or smoke
job). ``$VAR`` references in argv and env stay symbolic here and are expanded on the cluster (by
``trainer.launch.ray_entry``), as the recipe's ``command.sh`` has bash do it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import CheckError
from trainer.launch.host.local_cpu import data_parallel_only, prepare_rows
from trainer.launch.host.processes import default_kernel_cache
from trainer.redact import redact_field

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun
    from trainer.compose.schema import TrainConfig

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
REFERENCE_RE = re.compile(r"^(?P<name>[^@\s]+)@(?P<digest>sha256:[0-9a-f]{64})$")
ENV_NAMES = "RECIPE_BUNDLE_ENV_NAMES"  # the runtime env lists the recipe's variables here (comma-separated)
DIGEST_ENV = "RECIPE_BUNDLE_IMAGE_DIGEST"  # the image digest the job was started with (read by the probe)


def parse_image(reference: str, field: str = "launcher.image") -> tuple[str, str]:
    """Split ``NAME@sha256:<64 hex>`` into (name, digest); raises :class:`CheckError` naming ``field`` when the
    reference is not pinned by digest (a tag alone can move)."""
    match = REFERENCE_RE.match(reference or "")
    if not match:
        raise CheckError(
            f"{field} {redact_field(field, reference)!r}: expected an image pinned by digest, NAME@sha256:<64 hex>"
        )
    return match.group("name"), match.group("digest")


PAYLOADS = ("miles", "cpu")


def check_payload(cfg: TrainConfig) -> None:
    """``launcher.payload`` must be one of :data:`PAYLOADS`; ``cpu`` trains data parallel only (TP, PP, CP, EP,
    ETP 1) and without ``launcher.job``. Raises :class:`CheckError` naming the field."""
    payload = cfg.launcher.payload
    if payload not in PAYLOADS:
        raise CheckError(f"launcher.payload {payload!r}: expected one of {', '.join(PAYLOADS)}")
    if payload == "cpu":
        data_parallel_only(cfg, "launcher.payload cpu")
        if cfg.launcher.job:
            raise CheckError("launcher.job: give either launcher.job or launcher.payload=cpu, not both")


def cpu_job(
    prepared: PreparedRun, run_dir: Path, python: str, env: dict[str, str]
) -> tuple[list[str], dict[str, str], Path]:
    """The job of ``launcher.payload=cpu`` (argv, env) and its rows: the rows are prepared here, in ``run_dir``
    (absolute, on a file system the nodes share; :func:`trainer.launch.host.local_cpu.prepare_rows`); the job is
    :mod:`trainer.launch.ray_workers` over them with one process per slot of the layout (its world size), in the
    recipe's ``env`` with ``KERNEL_CACHE`` first (the submitter's, else the run's default as for a local run)."""
    rows = prepare_rows(prepared.config, run_dir).absolute()
    world = prepared.par.world_size
    argv = [python, "-m", "trainer.launch.ray_workers", str(run_dir), str(rows), "--world", str(world)]
    return argv, {"KERNEL_CACHE": os.environ.get("KERNEL_CACHE") or default_kernel_cache(run_dir), **env}, rows


def job(prepared: PreparedRun) -> tuple[list[str], dict[str, str]]:
    """The job's (argv, env): ``launcher.job`` or the prepared run's miles launch, and the recipe's environment.

    Both are exactly what ``command.sh`` runs (values keep their ``$VAR`` references).
    """
    launch = prepared.launch
    job_argv = prepared.config.launcher.job
    argv = [str(t) for t in job_argv] if job_argv else list(launch.argv)
    return argv, dict(launch.env)


ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
ERROR_LINE_RE = re.compile(r"^[\w.-]+: error: ")  # a program's own one-line error (``ray_workers: error: ...``)


def last_line(text: str) -> str:
    """The cause a log ends with: its last ``PROGRAM: error: ...`` line if it has one (Ray interleaves the actors'
    output after the driver's), else its last non-empty line; stripped of colour codes, or ``""``."""
    lines = [ANSI_RE.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if ERROR_LINE_RE.match(line)]
    return errors[-1] if errors else (lines[-1] if lines else "")
