"""``train``: the story of a run. Compose it with Hydra, check it, launch it (or plan it), record how it ended.

Usage (Hydra overrides; ``--help`` lists the groups)::

    python -m trainer.train                                  # the recipe: layout=tp2pp4ep8 on p5en-8x8
    python -m trainer.train layout=tp8pp8ep8 optim.lr=2e-5   # another layout, one field changed
    python -m trainer.train -m layout=tp2pp4ep8,tp8pp8ep8    # multirun: one plan per layout
    python -m trainer.train hydra.run.dir=DIR --resume       # into a DIR holding a run (--overwrite: replace it)

1. compose and check every job before any runs (:mod:`trainer.compose.prepare`; nothing is written on a refusal);
2. the run directory, Hydra's (:mod:`trainer.compose.commandline`), every file scrubbed of secrets (:func:`guarded`);
3. launch and record (:func:`run_one`: :mod:`trainer.launch`, :class:`trainer.record.rundir.RunDir`), an executed
   run attested (``--sign-key KEY``).

Exit codes: 0 ok, 2 refused input (one line on stderr), 1 an executed run that did not complete, 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainer import launch
from trainer.compose import commandline, schema
from trainer.compose.compose import CONF_DIR
from trainer.compose.prepare import PreparedRun, prepare
from trainer.errors import UserError
from trainer.record.attest import take_sign_key
from trainer.record.rundir import (COMPLETE, FAILED, FINAL, HANDED_OFF, INTERRUPTED, PLANNED, RUNNING, VERBATIM,
                                   RunDir, claim_run_dir, others_in)
from trainer.redact import Redactor, guard, scrub_file, sweep

SIGNER = None  # the signer of run attestations (--sign-key KEY), or None
RUN_DIR_MODE = "new"  # how a run directory that already holds a run is treated: new, resume, overwrite
COMMAND_LINE: List[str] = []  # the overrides as typed (a multirun's sweeps unexpanded)


def main() -> None:
    """Console entry point: prepare every job, claim the run directory, then run. Exit 2 with one line on bad
    input."""
    global COMMAND_LINE, RUN_DIR_MODE, SIGNER
    flags = {"--resume": "resume", "--overwrite": "overwrite"}
    modes = [flags[a] for a in sys.argv[1:] if a in flags]
    sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in flags)]
    if len(set(modes)) > 1:
        print("train: error: --resume and --overwrite exclude each other", file=sys.stderr)
        sys.exit(2)
    RUN_DIR_MODE = modes[0] if modes else "new"
    try:
        argv, SIGNER = take_sign_key(sys.argv[1:])
        COMMAND_LINE = list(argv)
        single = prepare_command_line(argv)
        sys.argv[1:] = argv  # the run directory's override made literal: what Hydra reads (a multirun, --cfg, ...)
    except UserError as err:
        print(f"train: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if single is None:
        schema.register()  # @hydra.main composes itself (a composition from the cache needs no ConfigStore)
        run()
    else:
        commandline.hydra_run(*single, task=lambda prepared, run_dir: guarded(prepared, Path(run_dir)))


def prepare_command_line(argv: List[str]):
    """:func:`trainer.compose.commandline.prepare_jobs`, then the run directory the command line names claimed
    (:func:`trainer.record.rundir.claim_run_dir`, in :data:`RUN_DIR_MODE`; for ``--resume`` with the job's
    ``composition_sha256``, :meth:`~trainer.compose.prepare.PreparedRun.record_fields`). ``argv`` is rewritten in
    place: a run-directory override with an interpolation becomes the literal it resolved to, the directory
    claimed and the one Hydra then uses. Returns the single plain run (or None: Hydra's entry point runs the
    command line). Raises :class:`UserError` (one line)."""
    single, named, literal = commandline.prepare_jobs(argv)
    if named:
        composition = None
        if RUN_DIR_MODE == "resume":
            jobs = list(commandline.PREPARED.values())
            composition = jobs[0].record_fields()["composition_sha256"] if len(jobs) == 1 else None
        claim_run_dir(named[1], RUN_DIR_MODE, named[0], composition=composition)
    argv[:] = literal
    return single


def run_one(prepared: PreparedRun, run_dir: Path) -> None:
    """One job in its run directory: the plan's files, then the launch (unless ``launcher=plan``), then how it
    ended. Exits 1 when an executed run did not complete, 2 (or the error's code) on input refused late."""
    rundir = RunDir(run_dir)
    rundir.write_plan(prepared)
    if prepared.launcher == "plan":
        from trainer.compose.summary import print_plan_summary

        rundir.begin(PLANNED, prepared.record_fields())
        print_plan_summary(prepared.plan, run_dir)
        return
    record = rundir.begin(RUNNING, prepared.record_fields())
    try:
        record = launch.execute(prepared, rundir, record)
    except UserError as err:
        fail(rundir, record, FAILED, str(err), f"train: error: {err}", err.exit_code)
    except KeyboardInterrupt:
        fail(rundir, record, INTERRUPTED, "interrupted by a signal", f"train: interrupted ({run_dir})", 130)
    except Exception as err:  # noqa: BLE001 - the record must say how the run ended, whatever ended it
        reason = f"{type(err).__name__}: {' '.join(str(err).split())}"
        fail(rundir, record, FAILED, f"launcher {prepared.launcher} raised {reason}",
             f"train: error: launcher {prepared.launcher} failed: {reason} ({run_dir})", 1)
    message = record.pop("message", None)
    handed_off = record["status"] in HANDED_OFF
    record = rundir.finish(record, SIGNER)
    print(message or f"run {record['status']}" + (f": {record['reason']}" if record.get("reason") else "")
          + f" ({run_dir})")
    if not handed_off and record["status"] != COMPLETE:
        sys.exit(1)


def fail(rundir: RunDir, record: dict, status: str, reason: str, line: str, code: int) -> None:
    """End ``record`` ``status`` (``reason``) after a launch that raised, unless the launcher had ended it already;
    attest and save it, print ``line`` on stderr and exit with ``code``."""
    rundir.seal(record if record["status"] in FINAL else rundir.end(record, status, reason), SIGNER)
    print(line, file=sys.stderr)
    sys.exit(code)


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")  # absolute: `trainer train` too
def run(cfg: DictConfig) -> None:
    """A job of a multirun (or of a command line :func:`main` leaves to Hydra): its prepared run, then
    :func:`guarded`."""
    hydra_cfg = HydraConfig.get()
    overrides = tuple(hydra_cfg.overrides.task)
    prepared = commandline.PREPARED.get(overrides)
    if prepared is None:
        try:
            prepared = prepare(overrides)
        except UserError as err:
            print(f"train: error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
    if hydra_cfg.mode == RunMode.MULTIRUN:  # Hydra's record of the sweep, written before the first job
        scrub_file(Path(hydra_cfg.sweep.dir) / "multirun.yaml", sweep_redactor())
    guarded(prepared, Path(hydra_cfg.runtime.output_dir))


def sweep_redactor() -> Redactor:
    """A redactor that knows the secrets of every job of the command line: the overrides as typed (a sweep
    ``+env.HF_TOKEN=a,b`` whole) and as each prepared job got them, and each job's environment block; frozen."""
    redactor = Redactor().learn_overrides(COMMAND_LINE)
    for job in commandline.PREPARED.values():
        learn_secrets(redactor, job)
    return redactor.freeze()


def learn_secrets(redactor: Redactor, prepared: PreparedRun) -> Redactor:
    """``redactor`` taught the secrets of one job: its overrides and its environment block's secret-named values."""
    env = OmegaConf.to_container(prepared.cfg.env, resolve=True) or {}
    return redactor.learn_overrides(list(prepared.overrides)).learn_env(env)


def guarded(prepared: PreparedRun, run_dir: Path) -> None:
    """:func:`run_one` in a run directory whose every file is scrubbed of the run's secrets (those of the
    overrides and of the environment block), Hydra's own files included. Refuses (exit 2) a directory Hydra chose
    that another run took in the meantime."""
    left = others_in(run_dir)
    if left and RUN_DIR_MODE == "new":
        print(f"train: error: {run_dir}: holds another run ({', '.join(left[:3])}); pass --resume or --overwrite",
              file=sys.stderr)
        sys.exit(2)
    redactor = learn_secrets(Redactor(), prepared).freeze()
    guard(run_dir, redactor)
    try:
        run_one(prepared, run_dir)
    finally:
        if sweep(run_dir, redactor, VERBATIM):  # a late rewrite: the record's hashes and the attestation follow it
            RunDir(run_dir).reseal(SIGNER)


if __name__ == "__main__":
    main()
