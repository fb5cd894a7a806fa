"""Launchers: what ``train`` does with a checked, planned run (``launcher=`` in ``conf/launcher/``).

The launchers themselves (the host side, run where ``train`` runs) are in :mod:`trainer.launch.host`; the
modules of this package next to it run inside the job, and their module paths are part of the commands and
scripts the launchers write: ``cpu_worker`` (a CPU data-parallel rank), ``megatron_worker`` (a megatron-core
rank under torchrun), ``ray_entry`` (a Ray job's entrypoint), ``ray_workers`` (places
one CPU worker per slot of a Ray cluster, ``launcher.payload=cpu``), ``preflight`` (compares the nodes' probes) and
``jobsteps`` (what ``sbatch.sh`` runs on the head node); ``megatron_args`` is shared by both sides.

``plan``       write the plan and launch nothing (no module: ``train`` does it);
``local-cpu``  train the composed (tiny) model on this machine's CPUs, data parallel over processes;
``local-megatron``  train the composed (proxy) model with megatron-core on this machine's GPUs (torchrun).

A launcher is a module in :data:`LAUNCHERS` with two functions:

``check(cfg: TrainConfig, par: Parallelism) -> None``
    launcher-specific pre-launch checks; runs when the job is prepared (:func:`trainer.compose.prepare.prepare`),
    before anything is written; raises :class:`~trainer.errors.CheckError` (one line).
``execute(prepared: PreparedRun, rundir: RunDir, record: dict) -> dict``
    runs the job of a :class:`~trainer.compose.prepare.PreparedRun` (its typed config, parallelism and rendered
    launch; nothing is composed or rendered again) into the run directory ``rundir``
    (:class:`~trainer.record.rundir.RunDir`: every file the launcher writes goes through it, so it is atomic and
    hashed into the record); ``record`` is the run record so far (already written with status ``running``); returns it
    moved by ``rundir`` to its next state (handed off, or ``complete`` / ``failed`` / ``interrupted``, with
    ``reason``) and with ``probe``. Raises
    :class:`~trainer.errors.UserError` for bad input found late (the caller marks the run failed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer.compose.checks import Parallelism
from trainer.compose.schema import TrainConfig
from trainer.errors import CheckError

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun
    from trainer.record.rundir import RunDir

LAUNCHERS: dict[str, str] = {
    "plan": "",
    "local-cpu": "trainer.launch.host.local_cpu",
    "slurm": "trainer.launch.host.slurm",
    "ray": "trainer.launch.host.ray",
    "local-image": "trainer.launch.host.local_image",
    "local-megatron": "trainer.launch.host.local_megatron",
}


def _module(name: str):
    if name not in LAUNCHERS:
        raise CheckError(f"launcher.name {name!r} is not one of {', '.join(sorted(LAUNCHERS))}")
    return importlib.import_module(LAUNCHERS[name]) if LAUNCHERS[name] else None


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Launcher-specific pre-launch checks; raises :class:`CheckError` with one line."""
    module = _module(cfg.launcher.name)
    if module is not None:
        module.check(cfg, par)


def execute(prepared: PreparedRun, rundir: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    """Run the prepared job with its launcher (not ``plan``) into ``rundir``; see the module docstring."""
    module = _module(prepared.launcher)
    assert module is not None, "plan launches nothing"
    return module.execute(prepared, rundir, record)
