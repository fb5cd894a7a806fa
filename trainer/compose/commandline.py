"""The command line of ``train`` as Hydra reads it: every job prepared before any runs, and a single job run in
Hydra's run directory the way ``@hydra.main`` runs one.

:func:`prepare_jobs` expands the overrides into jobs (a multirun sweep is one job per combination) and
prepares each (:func:`trainer.compose.prepare.prepare`; the prepared runs are kept in :data:`PREPARED` for the
jobs of a multirun, which Hydra's sweeper runs) and writes nothing: ``train`` claims the run directory the
command line names only once every job was prepared. :func:`hydra_run` is where the writing starts: it runs a
single job from its one composition (``hydra.core.utils.run_job``: Hydra makes the run directory, writes
``.hydra/`` and ``train.log``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import DictConfig

from trainer.compose.compose import expand_sweep, session
from trainer.compose.prepare import PreparedRun, prepare
from trainer.errors import UserError

# The jobs of the command line, prepared before any runs: their task overrides -> PreparedRun.
PREPARED: Dict[Tuple[str, ...], PreparedRun] = {}


def prepare_jobs(argv: List[str]) -> Tuple[Optional[Tuple[DictConfig, Any, PreparedRun]], Optional[Tuple[str, str]]]:
    """Prepare every job of a command line before any runs (into :data:`PREPARED`).

    Returns (``single``, ``named``): ``single`` is (the composition with its ``hydra`` node, Hydra's config
    loader or None when every composition came from the cache, the prepared run) of a single plain run, which
    :func:`hydra_run` then runs, or None when Hydra's own entry point is to run the command line (a multirun,
    also one chosen by ``hydra.mode=MULTIRUN``; ``--cfg``, ``--help``, ...); ``named`` is (``hydra.run.dir`` or
    ``hydra.sweep.dir``, its value) when the command line names the run directory, else None.

    Raises :class:`UserError` (one line) on a bad override, composition or check.
    """
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return None, None
    jobs = expand_sweep(args.overrides)
    if len(jobs) > 1 and not args.multirun:
        raise UserError(f"{' '.join(args.overrides)}: a sweep needs multirun (-m)")
    plain = not args.multirun and not (args.config_path or args.config_name or args.config_dir
                                       or args.experimental_rerun
                                       or any(o.startswith("hydra.mode=") for o in args.overrides))
    single = None
    with session() as composer:
        for job in jobs:
            try:
                # a single run is composed as @hydra.main composes it (hydra.mode=RUN among Hydra's overrides)
                full = composer.compose([*job, "hydra.mode=RUN"], hydra_node=True) if plain else None
                prepared = prepare(job, composer, full)
                PREPARED[prepared.overrides] = prepared
            except UserError as err:
                raise UserError(f"{' '.join(job) or '(defaults)'}: {err}" if len(jobs) > 1 else str(err)) from None
            single = (full, composer.config_loader, prepared) if plain else None
    field = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    given = [o.partition("=")[2] for o in args.overrides if o.lstrip("+").startswith(f"{field}=")]
    return single, ((field, given[-1]) if given else None)


def hydra_run(composed: DictConfig, config_loader: Any, prepared: PreparedRun,
              task: Callable[[PreparedRun, str], None]) -> None:
    """Run the single job ``prepared`` from its composition ``composed`` (with the ``hydra`` node) the way
    ``@hydra.main`` runs a job: Hydra makes the run directory and writes ``.hydra/`` and ``train.log``
    (``hydra.core.utils.run_job``), then ``task(prepared, run_dir)`` runs in it. An unexpected error is reported
    as ``@hydra.main`` reports it (``HYDRA_FULL_ERROR=1``: all of it)."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode

    def run() -> None:  # what Hydra.run does with a composition
        composed.hydra.mode = RunMode.RUN
        configure_log(composed.hydra.hydra_logging, composed.hydra.verbose)
        callbacks = Callbacks(composed)
        callbacks.on_run_start(config=composed, config_name="train")
        ret = run_job(
            hydra_context=HydraContext(config_loader=config_loader, callbacks=callbacks),
            task_function=lambda _cfg: task(prepared, HydraConfig.get().runtime.output_dir),
            config=composed, job_dir_key="hydra.run.dir", job_subdir_key=None, configure_logging=True)
        callbacks.on_run_end(config=composed, config_name="train", job_return=ret)
        _ = ret.return_value  # raises what the job raised

    run_and_report(run)
