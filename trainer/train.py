"""``train``: compose the recipe with Hydra, check it, render the miles launch and plan (or launch) it.

Usage (Hydra overrides)::

    python -m trainer.train                                  # the recipe: layout=tp2pp4ep8 on p5en-8x8
    python -m trainer.train layout=tp8pp8ep8 optim.lr=2e-5   # another layout, one field changed
    python -m trainer.train -m layout=tp2pp4ep8,tp8pp8ep8    # multirun: one plan per layout
    python -m trainer.train --cfg job                        # print the composed config
    python -m trainer.train hydra.run.dir=DIR --resume       # write into DIR although it holds a run (--overwrite:
                                                             # replace that run); without either DIR is refused

The story of a run: compose every job of the command line and check it (nothing is written if any job
fails), then for each job under ``@hydra.main``: check → render the launch → compare numerics with the
reference layout → plan → write the run directory → print a summary, or execute the run (``launcher=local-cpu``)
and attest it (``attestation.json``, signed with ``--sign-key KEY``: :mod:`trainer.record.attest`). Exit codes: 0 ok,
2 refused input (one line on stderr naming the field or override), 1 an executed run that did not complete.
"""

from __future__ import annotations

import hashlib
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import List

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainer import launch
from trainer.compose import checks, numerics, schema
from trainer.compose.stackpins import verify_stack
from trainer.compose.compose import compose_run, expand_sweep, validate
from trainer.errors import UserError
from trainer.compose.plan import build_plan
from trainer.publish import atomic_write
from trainer.record.record import launcher_record, write_json
from trainer.redact import Redactor, guard, redact_argv, redact_env, redactor_for, sweep
from trainer.record.rundir import HYDRA_FILES, claim_run_dir
from trainer.compose.render import render
from trainer.compose.summary import print_plan_summary


def preflight(argv: List[str]) -> None:
    """Compose and check every job of a command line before Hydra runs any of them.

    Raises :class:`UserError` (one line) on a bad override, composition or check.
    """
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return
    jobs = expand_sweep(args.overrides)
    if len(jobs) > 1 and not args.multirun:
        raise UserError(f"{' '.join(args.overrides)}: a sweep needs multirun (-m)")
    for job in jobs:
        cfg = compose_run(job)
        try:
            typed = validate(cfg)
            par = checks.check(typed)
            verify_stack(typed.stack)
            launch.check(typed, par)
        except UserError as err:
            raise UserError(f"{' '.join(job) or '(defaults)'}: {err}" if len(jobs) > 1 else str(err)) from None
    field = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    given = [o.partition("=")[2] for o in args.overrides if o.lstrip("+").startswith(f"{field}=")]
    if given:
        claim_run_dir(given[-1], RUN_DIR_MODE, field)


def reference_config(task_overrides: List[str], reference_layout: str) -> DictConfig:
    """The same composition with the layout replaced by the reference layout (for the numerics verdict)."""
    kept = [o for o in task_overrides if not o.lstrip("+~").startswith(("layout=", "layout.", "cluster="))]
    return compose_run(kept + [f"layout={reference_layout}"])


# Statuses of a run that now belongs to a scheduler (rendered for it, or accepted by it): not a failure.
HANDED_OFF = ("rendered", "submitted")
# The signer of run attestations (``--sign-key KEY``, taken off the command line by :func:`main`), or None.
SIGNER = None


def redact_files(run_dir: Path) -> None:
    """Pass the files others wrote into ``run_dir`` (Hydra's, the workers') through the run's redactor now, so that
    hashes taken next are those of the files as they stay."""
    redactor = redactor_for(run_dir)
    if redactor is not None:
        sweep(run_dir, redactor)


def attest_run(run_dir: Path, record: dict) -> None:
    """Write the run's ``attestation.json`` (:func:`trainer.record.attest.write_run_attestation`, signed when
    ``--sign-key`` was given) and name it in ``record``; a failure to attest is recorded, never fatal."""
    from trainer.record.attest import write_run_attestation

    redact_files(run_dir)  # the attestation hashes the files as they stay: redacted first

    try:
        record["attestation"] = write_run_attestation(run_dir, record, SIGNER)
    except (UserError, OSError, ValueError) as err:
        record["attestation"] = {"error": " ".join(str(err).split())}


def take_sign_key(argv: List[str]) -> List[str]:
    """``argv`` without ``--sign-key KEY`` / ``--sign-key=KEY`` (not a Hydra override); sets :data:`SIGNER`
    from the key. Raises :class:`UserError` for a missing value or a key that cannot sign."""
    global SIGNER
    out, key, i = [], None, 0
    while i < len(argv):
        word = argv[i]
        if word == "--sign-key":
            if i + 1 >= len(argv):
                raise UserError("--sign-key: expected the path of a private key (`trainer keygen --out KEY`)")
            key, i = argv[i + 1], i + 2
            continue
        if word.startswith("--sign-key="):
            key = word.split("=", 1)[1]
        else:
            out.append(word)
        i += 1
    if key is not None:
        from trainer.record.attest import load_signer

        SIGNER = load_signer(Path(key))
    return out


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> None:
    """One job: check, render, compare with the reference layout, plan, write the run directory, and
    execute it when the launcher is not ``plan``. Exits 1 when an executed run did not complete."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    left = sorted(p.name for p in run_dir.iterdir() if p.name not in HYDRA_FILES)
    if left and RUN_DIR_MODE == "new":  # a directory Hydra chose that another run took in the meantime
        print(f"train: error: {run_dir}: holds another run ({', '.join(left[:3])}); pass --resume or --overwrite",
              file=sys.stderr)
        sys.exit(2)
    overrides = list(HydraConfig.get().overrides.task)
    redactor = Redactor().learn_overrides(overrides).learn_env(OmegaConf.to_container(cfg.env, resolve=True) or {})
    guard(run_dir, redactor)
    try:
        _run(cfg, run_dir, overrides)
    finally:  # Hydra's own files (.hydra/, train.log) and whatever the launch wrote pass the same redaction
        sweep(run_dir, redactor)


def _run(cfg: DictConfig, run_dir: Path, overrides: List[str]) -> None:
    """The body of :func:`run`, writing under a guarded run directory."""
    typed = validate(cfg)
    par = checks.check(typed)
    verify_stack(typed.stack)
    launch.check(typed, par)
    launch_plan = render(cfg)
    reference = reference_config(overrides, typed.launcher.reference_layout)
    verdict = numerics.compare(cfg, reference)
    numerics_report = {"reference_layout": typed.launcher.reference_layout, **verdict.as_dict()}
    plan = build_plan(typed, par, numerics_report)

    hashes = {
        "config.yaml": atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode()),
        "command.sh": atomic_write(run_dir / "command.sh", launch_plan.shell_script().encode(), mode=0o777),
        "plan.json": write_json(run_dir / "plan.json", plan),
    }
    common = dict(
        kind="plan" if typed.launcher.name == "plan" else "run",
        launcher=typed.launcher.name,
        overrides=redact_argv(overrides),
        choices={k: v for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")},
        stack=OmegaConf.to_container(cfg.stack, resolve=True),
        lock={"path": "lockfiles/launcher.lock"},
    )
    if typed.launcher.name == "plan":
        hashes["argv.json"] = write_json(run_dir / "argv.json", launch_plan.argv)
        hashes["env.json"] = write_json(run_dir / "env.json", redact_env(launch_plan.env))
        write_json(run_dir / "record.json", launcher_record("planned", files_sha256=hashes, **common))
        print_plan_summary(plan, run_dir)
        return

    record = launcher_record("running", pid=os.getpid(), files_sha256=hashes, **common)
    record["started_utc"] = record["created_utc"]  # job start (a local run has no scheduler admission)
    write_json(run_dir / "record.json", record)
    try:
        record = launch.execute(typed, par, run_dir, record)
    except UserError as err:
        record.update(status="failed", reason=str(err))
        attest_run(run_dir, record)
        write_json(run_dir / "record.json", record)
        print(f"train: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        record.update(status="interrupted", reason="interrupted by a signal")
        attest_run(run_dir, record)
        write_json(run_dir / "record.json", record)
        print(f"train: interrupted ({run_dir})", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - the record must say how the run ended, whatever ended it
        reason = f"{type(err).__name__}: {' '.join(str(err).split())}"
        record.update(status="failed", reason=f"launcher {typed.launcher.name} raised {reason}")
        attest_run(run_dir, record)
        write_json(run_dir / "record.json", record)
        print(f"train: error: launcher {typed.launcher.name} failed: {reason} ({run_dir})", file=sys.stderr)
        sys.exit(1)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    handed_off = record["status"] in HANDED_OFF
    message = record.pop("message", None)
    redact_files(run_dir)
    for name in ("argv.json", "env.json", "metrics.jsonl", "sbatch.sh"):
        if (run_dir / name).is_file():
            hashes[name] = hashlib.sha256((run_dir / name).read_bytes()).hexdigest()
    if record["status"] == "submitted":
        # the job may already have started and written its own status (it drops our pid): keep what it wrote
        from trainer.record.rundir import load_record

        on_disk = load_record(run_dir) or {}
        if on_disk and "pid" not in on_disk:
            on_disk.setdefault("slurm", {}).update({k: v for k, v in (record.get("slurm") or {}).items() if v is not None})
            record = on_disk
    if handed_off:
        record.pop("pid", None)  # the run no longer lives in this process
        record["handed_off_utc"] = now
    else:
        record["finished_utc"] = now
    record.setdefault("files_sha256", {}).update(hashes)
    if not handed_off:
        attest_run(run_dir, record)
    write_json(run_dir / "record.json", record)
    print(message or f"run {record['status']}" + (f": {record['reason']}" if record.get("reason") else "") + f" ({run_dir})")
    if not handed_off and record["status"] != "complete":
        sys.exit(1)


# How `train` treats a run directory that already holds a run (--resume, --overwrite; see rundir.claim_run_dir).
RUN_DIR_MODE = "new"


def main() -> None:
    """Console entry point: preflight every job, then run Hydra. Exit 2 with one line on bad input.

    ``--resume`` writes into a run directory that holds a run, ``--overwrite`` replaces that run; without either
    such a directory is refused (:func:`trainer.record.rundir.claim_run_dir`).
    """
    global RUN_DIR_MODE
    schema.register()
    flags = {"--resume": "resume", "--overwrite": "overwrite"}
    modes = [flags[a] for a in sys.argv[1:] if a in flags]
    sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in flags)]
    if len(set(modes)) > 1:
        print("train: error: --resume and --overwrite exclude each other", file=sys.stderr)
        sys.exit(2)
    RUN_DIR_MODE = modes[0] if modes else "new"
    try:
        sys.argv[1:] = take_sign_key(sys.argv[1:])
        preflight(sys.argv[1:])
    except UserError as err:
        print(f"train: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    run()


if __name__ == "__main__":
    main()
