"""Launchers: what ``train`` does with a checked, planned run (``launcher=`` in ``conf/launcher/``).

``plan``       write the plan and launch nothing;
``local-cpu``  train the composed (tiny) model on this machine's CPUs, data parallel over processes.

Each launcher has a ``check(cfg, par)`` that runs in ``train``'s preflight (before anything is written)
and an ``execute(cfg, typed, par, run_dir) -> status`` that runs the job and returns its final status.
"""

from __future__ import annotations

from trainer.checks import Parallelism
from trainer.errors import CheckError
from trainer.schema import TrainConfig

NAMES = ("plan", "local-cpu")


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Launcher-specific pre-launch checks; raises :class:`CheckError` with one line."""
    name = cfg.launcher.name
    if name not in NAMES:
        raise CheckError(f"launcher.name {name!r} is not one of {', '.join(NAMES)}")
    if name == "local-cpu":
        from trainer.launch.local_cpu import check as cpu_check

        cpu_check(cfg, par)
