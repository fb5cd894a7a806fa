"""``train``: compose the recipe with Hydra, check it, render the miles launch and plan (or launch) it.

Usage (Hydra overrides)::

    python -m trainer.train                                  # the recipe: layout=tp2pp4ep8 on p5en-8x8
    python -m trainer.train layout=tp8pp8ep8 optim.lr=2e-5   # another layout, one field changed
    python -m trainer.train -m layout=tp2pp4ep8,tp8pp8ep8    # multirun: one plan per layout
    python -m trainer.train --cfg job                        # print the composed config
    python -m trainer.train hydra.run.dir=DIR --resume       # write into DIR although it holds a run (--overwrite:
                                                             # replace that run); without either DIR is refused

The story of a run: every job of the command line is prepared first (:func:`trainer.compose.prepare.prepare`:
composed once, with the reference layout, checked, rendered, planned; nothing is written if any job fails);
then each job gets its run directory from Hydra (``hydra.core.utils.run_job`` with that composition; a multirun
goes through ``@hydra.main``'s sweeper) and :func:`run_one` writes the plan, launches and records it
(:class:`trainer.record.rundir.RunDir`), attesting an executed run (``attestation.json``, signed with
``--sign-key KEY``: :mod:`trainer.record.attest`). Exit codes: 0 ok, 2 refused input (one line on stderr naming
the field or override), 1 an executed run that did not complete.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainer import launch
from trainer.compose import schema
from trainer.compose.compose import CONF_DIR, expand_sweep, session
from trainer.compose.prepare import PreparedRun, prepare
from trainer.errors import UserError
from trainer.record.rundir import (ARGV, COMMAND, COMPLETE, CONFIG, ENV, FAILED, FINAL, HANDED_OFF, HYDRA_FILES,
                                   INTERRUPTED, PLAN, PLANNED, RUNNING, RunDir, claim_run_dir)
from trainer.record.attest import attest_run, take_sign_key
from trainer.redact import Redactor, guard, redact_argv, redact_env, resweep, sweep

# The signer of run attestations (``--sign-key KEY``, taken off the command line by :func:`main`), or None.
SIGNER = None
# How `train` treats a run directory that already holds a run (--resume, --overwrite; see rundir.claim_run_dir).
RUN_DIR_MODE = "new"
# The jobs of the command line, prepared before any runs: their task overrides -> PreparedRun.
PREPARED: Dict[Tuple[str, ...], PreparedRun] = {}


def main() -> None:
    """Console entry point: prepare every job, then run them. Exit 2 with one line on bad input.

    ``--resume`` writes into a run directory that holds a run, ``--overwrite`` replaces that run; without either
    such a directory is refused (:func:`trainer.record.rundir.claim_run_dir`).
    """
    global RUN_DIR_MODE, SIGNER
    flags = {"--resume": "resume", "--overwrite": "overwrite"}
    modes = [flags[a] for a in sys.argv[1:] if a in flags]
    sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in flags)]
    if len(set(modes)) > 1:
        print("train: error: --resume and --overwrite exclude each other", file=sys.stderr)
        sys.exit(2)
    RUN_DIR_MODE = modes[0] if modes else "new"
    try:
        sys.argv[1:], SIGNER = take_sign_key(sys.argv[1:])
        single = prepare_command_line(sys.argv[1:])
    except UserError as err:
        print(f"train: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if single is None:
        schema.register()  # @hydra.main composes itself (a composition from the cache needs no ConfigStore)
        run()
    else:
        hydra_run(*single)


def run_one(prepared: PreparedRun, run_dir: Path) -> None:
    """One job, the story of a run: write the plan into ``run_dir``, launch it (unless ``launcher=plan``) and
    record how it ended. Exits 1 when an executed run did not complete, 2 (or the error's code) on input refused
    late."""
    rundir = RunDir(run_dir)
    write_plan(rundir, prepared)
    common = record_fields(prepared)
    if prepared.launcher == "plan":
        from trainer.compose.summary import print_plan_summary
        from trainer.record.record import launcher_record

        rundir.write_json(ARGV, prepared.launch.argv)
        rundir.write_json(ENV, redact_env(prepared.launch.env))
        rundir.save_record(launcher_record(PLANNED, files_sha256=rundir.hashes, **common))
        print_plan_summary(prepared.plan, run_dir)
        return
    record = start(rundir, common)
    try:
        record = launch.execute(prepared, rundir, record)
    except UserError as err:
        fail(rundir, ended(rundir, record, FAILED, str(err)), f"train: error: {err}", err.exit_code)
    except KeyboardInterrupt:
        fail(rundir, ended(rundir, record, INTERRUPTED, "interrupted by a signal"), f"train: interrupted ({run_dir})",
             130)
    except Exception as err:  # noqa: BLE001 - the record must say how the run ended, whatever ended it
        reason = f"{type(err).__name__}: {' '.join(str(err).split())}"
        fail(rundir, ended(rundir, record, FAILED, f"launcher {prepared.launcher} raised {reason}"),
             f"train: error: launcher {prepared.launcher} failed: {reason} ({run_dir})", 1)
    finish(rundir, record)


def write_plan(rundir: RunDir, prepared: PreparedRun) -> None:
    """``config.yaml`` (the resolved composition), ``command.sh`` (the launch as bash) and ``plan.json``."""
    rundir.write(CONFIG, OmegaConf.to_yaml(prepared.cfg, resolve=True).encode())
    rundir.write(COMMAND, prepared.launch.shell_script().encode(), mode=0o777)
    rundir.write_json(PLAN, prepared.plan)


def record_fields(prepared: PreparedRun) -> dict:
    """What every record of this run says about its composition."""
    return dict(
        kind="plan" if prepared.launcher == "plan" else "run",
        launcher=prepared.launcher,
        overrides=redact_argv(list(prepared.overrides)),
        choices=prepared.choices,
        stack=OmegaConf.to_container(prepared.cfg.stack, resolve=True),
        lock={"path": "lockfiles/launcher.lock"},
    )


def start(rundir: RunDir, common: dict) -> dict:
    """The record of a run about to launch (``running``, this process's pid), saved."""
    from trainer.record.record import launcher_record

    record = launcher_record(RUNNING, pid=os.getpid(), files_sha256=rundir.hashes, **common)
    record["started_utc"] = record["created_utc"]  # job start (a local run has no scheduler admission)
    rundir.save_record(record)
    return record


def ended(rundir: RunDir, record: dict, status: str, reason: str) -> dict:
    """``record`` ended ``status`` (``reason``) by a launch that raised, unless the launcher had already ended it."""
    return record if record["status"] in FINAL else rundir.end(record, status, reason)


def fail(rundir: RunDir, record: dict, line: str, code: int) -> None:
    """Attest and save the record of a run that ended badly, print ``line`` on stderr and exit with ``code``."""
    attest_run(rundir.path, record, SIGNER)
    rundir.save_record(record)
    print(line, file=sys.stderr)
    sys.exit(code)


def finish(rundir: RunDir, record: dict) -> None:
    """Record a run the launcher handed back (ended, or handed off to a scheduler) and say so on one line."""
    message = record.pop("message", None)
    handed_off = record["status"] in HANDED_OFF  # as the launcher says: a submitted job may have moved on since
    resweep(rundir.path)
    rundir.hash_written()  # what the workers wrote (metrics.jsonl)
    record = rundir.hand_back(record)
    if not handed_off:
        attest_run(rundir.path, record, SIGNER)
    rundir.save_record(record)
    print(message or f"run {record['status']}" + (f": {record['reason']}" if record.get("reason") else "")
          + f" ({rundir.path})")
    if not handed_off and record["status"] != COMPLETE:
        sys.exit(1)


def prepare_command_line(argv: List[str]) -> Optional[Tuple[DictConfig, Any, PreparedRun]]:
    """Prepare every job of a command line before any runs (into :data:`PREPARED`) and claim the run directory it
    names. Returns (the composition with its ``hydra`` node, Hydra's config loader, the prepared run) of a single
    plain run, which :func:`hydra_run` then runs; None when Hydra's own entry point is to run the command line
    (a multirun, also one chosen by ``hydra.mode=MULTIRUN``; ``--cfg``, ``--help``, ...).

    Raises :class:`UserError` (one line) on a bad override, composition or check.
    """
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return None
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
    if given:
        claim_run_dir(given[-1], RUN_DIR_MODE, field)
    return single


def hydra_run(composed: DictConfig, config_loader: Any, prepared: PreparedRun) -> None:
    """Run the single job ``prepared`` from its composition ``composed`` (with the ``hydra`` node) the way
    ``@hydra.main`` runs a job: Hydra makes the run directory and writes ``.hydra/`` and ``train.log``
    (``hydra.core.utils.run_job``), then :func:`guarded` runs in it."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode

    def run() -> None:  # what Hydra.run does with a composition
        composed.hydra.mode = RunMode.RUN
        configure_log(composed.hydra.hydra_logging, composed.hydra.verbose)
        callbacks = Callbacks(composed)
        callbacks.on_run_start(config=composed, config_name="train")
        ret = run_job(
            hydra_context=HydraContext(config_loader=config_loader, callbacks=callbacks),
            task_function=lambda _cfg: guarded(prepared, Path(HydraConfig.get().runtime.output_dir),
                                               list(prepared.overrides)),
            config=composed, job_dir_key="hydra.run.dir", job_subdir_key=None, configure_logging=True)
        callbacks.on_run_end(config=composed, config_name="train", job_return=ret)
        _ = ret.return_value  # raises what the job raised

    run_and_report(run)  # an unexpected error is reported as @hydra.main reports it (HYDRA_FULL_ERROR=1: all of it)


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")  # absolute: `trainer train` too
def run(cfg: DictConfig) -> None:
    """A job of a multirun (or of a command line :func:`main` leaves to Hydra): its prepared run, then
    :func:`guarded`."""
    overrides = list(HydraConfig.get().overrides.task)
    prepared = PREPARED.get(tuple(overrides))
    if prepared is None:
        try:
            prepared = prepare(overrides)
        except UserError as err:
            print(f"train: error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
    guarded(prepared, Path(HydraConfig.get().runtime.output_dir), overrides)


def guarded(prepared: PreparedRun, run_dir: Path, overrides: List[str]) -> None:
    """:func:`run_one` under a run directory whose every file is scrubbed of the run's secrets (those of the
    overrides and the environment block)."""
    left = sorted(p.name for p in run_dir.iterdir() if p.name not in HYDRA_FILES)
    if left and RUN_DIR_MODE == "new":  # a directory Hydra chose that another run took in the meantime
        print(f"train: error: {run_dir}: holds another run ({', '.join(left[:3])}); pass --resume or --overwrite",
              file=sys.stderr)
        sys.exit(2)
    env = OmegaConf.to_container(prepared.cfg.env, resolve=True) or {}
    redactor = Redactor().learn_overrides(overrides).learn_env(env)
    guard(run_dir, redactor)
    try:
        run_one(prepared, run_dir)
    finally:  # Hydra's own files (.hydra/, train.log) and whatever the launch wrote pass the same redaction
        sweep(run_dir, redactor)


if __name__ == "__main__":
    main()
