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

What the command line chose (:class:`RunOptions`) and what one ``train`` prints through (:class:`Invocation`) are
made by :func:`main` and handed down as arguments: no module global holds a run's state, so two runs in one process
(tests, a notebook) never see each other's.

Exit codes: 0 ok, 2 refused input (one line on stderr), 1 an executed run that did not complete, 70 an internal
error (a bug: one line ``train: internal error: ...``; ``TRAINER_DEBUG=1`` adds the traceback), 130 interrupted.

Everything ``train`` and Hydra print goes through one redactor (:func:`trainer.redact.redacted_streams`): the
secrets of the command line as Hydra reads it and of this process's environment, then of each job's environment
block, and the rule's patterns; an error line is also scrubbed of the values, however short, of the overrides
that set secret-named keys (:func:`error_line`). A run directory holding a symbolic link is refused
(:func:`refuse_links`): Hydra would write the overrides through it, past the redaction of the directory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainer import launch, runlog
from trainer.compose import commandline, schema
from trainer.compose.compose import CONF_DIR
from trainer.compose.prepare import FROZEN, PreparedRun, prepare
from trainer.compose.summary import print_plan_summary
from trainer.errors import EX_SOFTWARE, STORAGE_ERRNOS, UserError, internal_error_report, os_error_line, place_error
from trainer.record import attempts as run_attempts
from trainer.record.attest import ATTESTATION, take_sign_key
from trainer.record.rundir import (
    COMPLETE,
    FAILED,
    FINAL,
    HANDED_OFF,
    INTERRUPTED,
    PLANNED,
    RUNNING,
    VERBATIM,
    RunDir,
    claim_run_dir,
    others_in,
    scrub_file,
    sweep,
)
from trainer.redact import Redactor, guarding, redacted_streams

RUN_DIR_MODES = ("new", "resume", "overwrite")  # how a run directory that already holds a run is treated


@dataclass(frozen=True)
class RunOptions:
    """What one ``train`` command line chose for every job of it, made once by :func:`run_main` and handed down.

    ``mode``: one of :data:`RUN_DIR_MODES` (``--resume``, ``--overwrite``; default ``new``); ``signer``: the signer
    of run attestations (``--sign-key KEY``, :func:`trainer.record.attest.take_sign_key`), or None;
    ``command_line``: the overrides as typed (a multirun's sweeps unexpanded, ``--sign-key`` taken out)."""

    mode: str = "new"
    signer: Any = None
    command_line: tuple[str, ...] = ()


@dataclass
class Invocation:
    """One ``train`` process's run of a command line: its :class:`RunOptions`, the prepared jobs
    (``overrides -> PreparedRun``), and what its output passes through: ``streams`` (stdout and stderr, taught the
    command line's and then each job's secrets) and ``errors`` (an error line: also the short values of secret
    overrides); ``reported``: the lines of full-disk errors already printed (:func:`out_of_room`), not printed
    twice. Made by :func:`main`, passed to every step; gone when the command line ends."""

    streams: Redactor
    errors: Redactor
    options: RunOptions = RunOptions()
    jobs: Mapping[tuple[str, ...], PreparedRun] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, argv: list[str]) -> Invocation:
        """The redactors taught the secrets of ``argv`` (as Hydra reads each override) and of this process's
        environment, both frozen (they learn nothing from what they scrub)."""
        inherited = Redactor().learn_env(os.environ)
        return cls(
            streams=Redactor().learn_overrides(argv).teach(inherited).freeze(),
            errors=Redactor(short=1).learn_overrides(argv).teach(inherited).freeze(),
        )

    def error_line(self, err: object) -> str:
        """``train: error: ERR`` with the secrets of the command line (and of the jobs so far) replaced."""
        return self.errors.scrub(f"train: error: {err}")

    def teach(self, redactor: Redactor) -> None:
        """Both redactors taught the values ``redactor`` knows (a job's secrets, once it is prepared)."""
        self.streams.teach(redactor)
        self.errors.teach(redactor)


def main() -> None:
    """Console entry point: :func:`run_main` with stdout and stderr redacted (:attr:`Invocation.streams`), the
    records of the job's log held until Hydra opens it and redacted too (:func:`trainer.runlog.session`)."""
    prog = os.environ.pop("TRAINER_PROG", "")
    if prog:  # bin/train: the name Hydra's shell completion binds and prints (`eval "$(bin/train -sc install=bash)"`)
        sys.argv[0] = prog
        import hydra._internal.utils as hydra_utils

        hydra_utils._get_exec_command = lambda: prog  # Hydra would print only the name: `train`, not `bin/train`
    invocation = Invocation.of(sys.argv[1:])
    frozen = os.environ.get(FROZEN)  # --frozen sets it for this command line (and its workers) only
    try:
        with runlog.session(invocation.streams), redacted_streams(invocation.streams, errors=invocation.errors):
            run_main(invocation)
    finally:
        if frozen is None:
            os.environ.pop(FROZEN, None)
        else:
            os.environ[FROZEN] = frozen


def run_main(invocation: Invocation) -> None:
    """Read the options, prepare every job, claim the run directory, then run. Exit 2 with one line on bad input."""
    flags = {"--resume": "resume", "--overwrite": "overwrite"}
    modes = [flags[a] for a in sys.argv[1:] if a in flags]
    if "--frozen" in sys.argv[1:]:  # lockfiles/launcher.lock as it is, even when launcher.in changed since
        os.environ[FROZEN] = "1"
    sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in flags and a != "--frozen")]
    if len(set(modes)) > 1:
        print("train: error: --resume and --overwrite exclude each other", file=sys.stderr)
        sys.exit(2)
    try:
        argv, signer = take_sign_key(sys.argv[1:])
        invocation.options = RunOptions(modes[0] if modes else "new", signer, tuple(argv))
        single, invocation.jobs = prepare_command_line(argv, invocation.options.mode)
        sys.argv[1:] = argv  # the run directory's override made literal: what Hydra reads (a multirun, --cfg, ...)
    except (UserError, OSError) as err:  # an OSError of a path given (a name too long, a key not readable)
        err = place_error(err) or err if isinstance(err, OSError) else err
        if not isinstance(err, UserError):
            raise err
        print(invocation.error_line(err), file=sys.stderr)
        sys.exit(err.exit_code)
    if single is None:
        schema.register()  # @hydra.main composes itself (a composition from the cache needs no ConfigStore)
        hydra_main(invocation)
    else:
        composed, config_loader, job = single
        commandline.hydra_run(
            composed,
            config_loader,
            job,
            task=lambda prepared, run_dir: reported(invocation, prepared, Path(run_dir)),
            unfinished=scrub_unfinished,
        )


def prepare_command_line(
    argv: list[str], mode: str = "new"
) -> tuple[commandline.Single | None, dict[tuple[str, ...], PreparedRun]]:
    """:func:`trainer.compose.commandline.prepare_jobs`, then the run directory the command line names claimed
    (:func:`trainer.record.rundir.claim_run_dir`, in ``mode``, one of :data:`RUN_DIR_MODES`; for ``--resume``
    with the job's ``composition_sha256``, :meth:`~trainer.compose.prepare.PreparedRun.record_fields`). ``argv``
    is rewritten in place: a run-directory override with an interpolation becomes the literal it resolved to, the
    directory claimed and the one Hydra then uses. Returns the single plain run (or None: Hydra's entry point
    runs the command line) and every job's prepared run by its task overrides. Raises :class:`UserError` (one
    line)."""
    single, named, literal, jobs = commandline.prepare_jobs(argv, launch.check)
    if named:
        composition = None
        if mode == "resume":
            prepared = list(jobs.values())
            composition = prepared[0].record_fields()["composition_sha256"] if len(prepared) == 1 else None
        claim_run_dir(named[1], mode, named[0], composition=composition)
        refuse_links(Path(named[1]))
        if mode == "resume":  # the checkpoint it continues from checked before Hydra writes into it
            run_attempts.ended_attempt(Path(named[1]))
    argv[:] = literal
    return single, jobs


def refuse_links(directory: Path) -> None:
    """Raise :class:`UserError` naming the first symbolic link under ``directory`` (not followed), in every mode: a
    run there would have Hydra write ``.hydra/`` or ``train.log`` through it, over a file elsewhere and outside
    what is redacted and attested (``--overwrite`` has removed a run's own links by now)."""
    if directory.is_symlink() or not directory.is_dir():
        return
    for root, dirs, files in os.walk(directory):
        for name in sorted(dirs + files):
            path = Path(root) / name
            if path.is_symlink():
                raise UserError(
                    f"{path}: a symbolic link in the run directory; train writes Hydra's files "
                    "(.hydra/, train.log) only into a directory without links: remove it"
                )


def run_one(invocation: Invocation, prepared: PreparedRun, run_dir: Path) -> None:
    """One job in its run directory: the plan's files, then the launch (unless ``launcher=plan``), then how it
    ended. Exits 1 when an executed run did not complete, 2 (or the error's code) on input refused late."""
    rundir = RunDir(run_dir)
    previous = run_attempts.ended_attempt(run_dir) if prepared.launcher != "plan" else None  # only a --resume
    attempts = run_attempts.continue_attempt(run_dir, previous) if previous else {}  # before write_plan's files
    rundir.write_plan(prepared)
    if prepared.launcher == "plan":
        rundir.begin(PLANNED, prepared.record_fields())
        print_plan_summary(prepared.plan, run_dir)
        return
    record = rundir.begin(RUNNING, {**prepared.record_fields(), **attempts})
    if attempts:
        resumed = attempts["resumed_from"]
        runlog.info(
            f"attempt {resumed['attempt'] + 1}: resumed from "
            + (f"{resumed['checkpoint']} (step {resumed['iteration']})" if resumed["iteration"] else "the start")
        )
    try:
        record = launch.execute(prepared, rundir, record)
    except UserError as err:
        fail(invocation, rundir, record, FAILED, str(err), invocation.error_line(err), err.exit_code)
    except KeyboardInterrupt:
        fail(invocation, rundir, record, INTERRUPTED, "interrupted by a signal", f"train: interrupted ({run_dir})", 130)
    except Exception as err:  # noqa: BLE001 - the record must say how the run ended, whatever ended it
        reason = (
            os_error_line(err)
            if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS  # a full disk
            else f"{type(err).__name__}: {' '.join(str(err).split())}"
        )
        fail(
            invocation,
            rundir,
            record,
            FAILED,
            f"launcher {prepared.launcher} raised {reason}",
            invocation.error_line(f"launcher {prepared.launcher} failed: {reason} ({run_dir})"),
            1,
        )
    message = record.pop("message", None)
    handed_off = record["status"] in HANDED_OFF
    # the log's last line goes in before the run is sealed (train.log is one of the files its record hashes)
    runlog.info(message or f"run {record['status']}" + (f": {record['reason']}" if record.get("reason") else ""))
    try:
        record = rundir.finish(record, invocation.options.signer)
    except OSError as err:  # the disk filled during the run: the record says so where it can (exit 1)
        out_of_room(invocation, rundir, record, err)
    print(
        message
        or f"run {record['status']}" + (f": {record['reason']}" if record.get("reason") else "") + f" ({run_dir})"
    )
    if not handed_off and record["status"] != COMPLETE:
        sys.exit(1)


def fail(invocation: Invocation, rundir: RunDir, record: dict, status: str, reason: str, line: str, code: int) -> None:
    """End ``record`` ``status`` (``reason``) after a launch that raised, unless the launcher had ended it already;
    attest and save it, print ``line`` on stderr and exit with ``code``."""
    runlog.log.error(line)  # before the seal: train.log is one of the files the record hashes
    try:
        ended = record if record["status"] in FINAL else rundir.end(record, status, reason)
        rundir.seal(ended, invocation.options.signer)
    except OSError as err:
        out_of_room(invocation, rundir, record, err)
    print(line, file=sys.stderr)
    sys.exit(code)


def out_of_room(invocation: Invocation, rundir: RunDir, record: dict, err: OSError) -> None:
    """After a write of a run's end stopped on the place (``err``: a full disk, a quota, a read-only mount;
    any other error is raised again): the run recorded failed with the reason where there is room
    (:meth:`~trainer.record.rundir.RunDir.record_out_of_room`), one line on stderr saying what the record says,
    exit 1."""
    if err.errno not in STORAGE_ERRNOS:
        raise err
    invocation.reported.add(os_error_line(err))
    saved = rundir.record_out_of_room(record, err)
    print(
        f"train: error: run {record.get('status')}: {record.get('reason') or os_error_line(err)} ({rundir.path}); "
        + (
            "its record says so, not attested"
            if saved
            else "record.json could not be updated: `trainer status` "
            "reports the run interrupted once this process has ended"
        ),
        file=sys.stderr,
    )
    sys.exit(1)


def hydra_main(invocation: Invocation) -> None:
    """The command line run by Hydra's own entry point (``@hydra.main``: a multirun, ``--cfg``, ``--help``, shell
    completion), each job through :func:`hydra_job` with ``invocation``, which the decorated function closes
    over (no module global carries it to the job)."""

    @hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")  # absolute: `trainer train` too
    def run(cfg: DictConfig) -> None:
        hydra_job(invocation)

    run()


def hydra_job(invocation: Invocation) -> None:
    """A job of a multirun (or of a command line :func:`main` leaves to Hydra): its prepared run, then
    :func:`guarded` (through :func:`reported`)."""
    hydra_cfg = HydraConfig.get()
    overrides = tuple(hydra_cfg.overrides.task)
    prepared = invocation.jobs.get(overrides)
    if prepared is None:
        try:
            prepared = prepare(overrides, check_launcher=launch.check)
        except UserError as err:
            print(invocation.error_line(err), file=sys.stderr)
            sys.exit(err.exit_code)
    if hydra_cfg.mode == RunMode.MULTIRUN:  # Hydra's record of the sweep, written before the first job
        scrub_file(Path(hydra_cfg.sweep.dir) / "multirun.yaml", sweep_redactor(invocation))
    try:
        reported(invocation, prepared, Path(hydra_cfg.runtime.output_dir))
    except OSError as err:  # a full disk, a name too long: one line (Hydra's own writes of a sweep excepted)
        if place_error(err) is None:
            raise
        print(f"train: error: {place_error(err)}", file=sys.stderr)
        sys.exit(2)


def reported(invocation: Invocation, prepared: PreparedRun, run_dir: Path) -> None:
    """:func:`guarded`, where an exception that is neither bad input (:class:`UserError`: its line, its exit code)
    nor an ``OSError`` (its caller's) is a bug: one line ``train: internal error: ...`` (redacted as every error
    line; ``TRAINER_DEBUG=1``: after its traceback) and exit 70, not Hydra's report of a failed job."""
    try:
        guarded(invocation, prepared, run_dir)
    except UserError as err:
        print(invocation.error_line(err), file=sys.stderr)
        sys.exit(err.exit_code)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - no check turned it into a UserError: a bug, said as one
        print(invocation.errors.scrub(internal_error_report("train", err)), end="", file=sys.stderr)
        sys.exit(EX_SOFTWARE)


def sweep_redactor(invocation: Invocation) -> Redactor:
    """A redactor that knows the secrets of every job of the command line: the overrides as typed (a sweep
    ``+env.HF_TOKEN=a,b`` whole) and as each prepared job got them, and each job's environment block; frozen."""
    redactor = Redactor().learn_overrides(invocation.options.command_line).learn_env(os.environ)
    for job in invocation.jobs.values():
        learn_secrets(redactor, job)
    return redactor.freeze()


def learn_secrets(redactor: Redactor, prepared: PreparedRun) -> Redactor:
    """``redactor`` taught the secrets of one job: its overrides and its environment block's secret-named values."""
    env = OmegaConf.to_container(prepared.cfg.env, resolve=True)
    variables = {str(name): value for name, value in env.items()} if isinstance(env, dict) else {}
    return redactor.learn_overrides(list(prepared.overrides)).learn_env(variables)


def scrub_unfinished(prepared: PreparedRun, run_dir: str) -> None:
    """Pass what Hydra wrote into ``run_dir`` before it failed (a full disk while writing ``.hydra/``) through the
    job's redactor, as :func:`guarded` would have after the run; a sweep that fails too is said in one line."""
    redactor = learn_secrets(Redactor(), prepared).learn_env(os.environ).freeze()
    try:
        sweep(Path(run_dir), redactor, VERBATIM)
    except OSError as err:
        print(f"train: error: {os_error_line(err)} (not swept of secrets)", file=sys.stderr)


def guarded(invocation: Invocation, prepared: PreparedRun, run_dir: Path) -> None:
    """:func:`run_one` in a run directory whose every file is scrubbed of the run's secrets (those of the
    overrides and of the environment block), Hydra's own files included. Refuses (exit 2) a directory Hydra chose
    that another run took in the meantime."""
    left = others_in(run_dir)
    if left and invocation.options.mode == "new":
        print(
            f"train: error: {run_dir}: holds another run ({', '.join(left[:3])}); pass --resume or --overwrite",
            file=sys.stderr,
        )
        sys.exit(2)
    runlog.release()  # Hydra has opened the job's log (train.log): what was decided before goes in first
    runlog.info(
        f"run directory {run_dir}: overrides {' '.join(prepared.overrides) or '(none)'}; launcher {prepared.launcher}"
    )
    redactor = learn_secrets(Redactor(), prepared).learn_env(os.environ).freeze()
    invocation.teach(redactor)
    with guarding(run_dir, redactor):  # for this job only: the next job (of a multirun, of a test) has its own
        try:
            sweep(run_dir, redactor, (*VERBATIM, ATTESTATION))  # Hydra's .hydra/ now, not only once the run ended
            run_one(invocation, prepared, run_dir)
        finally:
            ending = sys.exc_info()[1]
            try:
                # a late rewrite: the record's hashes and the attestation follow it (scrubbed before it was signed)
                if sweep(run_dir, redactor, (*VERBATIM, ATTESTATION)):
                    RunDir(run_dir).reseal(invocation.options.signer)
            except OSError as err:  # a full disk as the run ended (out_of_room): the error in flight and code stand
                if err.errno not in STORAGE_ERRNOS or ending is None:
                    raise
                if os_error_line(err) not in invocation.reported:
                    print(f"train: error: {os_error_line(err)} (not swept of secrets)", file=sys.stderr)


if __name__ == "__main__":
    main()
