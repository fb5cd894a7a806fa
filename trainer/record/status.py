"""``trainer status RUN_DIR [--wait] [--timeout S] [--json]``: where a run stands, following its Slurm job.

The run record says what the launcher and the job itself wrote (``rendered``, ``submitted``, ``running``,
``complete``, ``failed``, ``interrupted``). For a Slurm run that is not finished the Slurm job's state is read
(``squeue``, then ``scontrol show job``); a job that Slurm says has ended while the record still says
``submitted``/``running`` (killed before its script could record anything: node failure, ``scancel -s KILL``)
is recorded as ``failed`` with Slurm's state, the job's nodes Slurm says are down or not responding and the
ranks the job placed there (:func:`lost_nodes`: the job's first node lost takes the script with it), so the
record never claims a run that is gone. A local run whose
record says ``running`` while its process is gone (:func:`trainer.record.record.process_gone`: it ended without a
word, as when its disk filled; its pid was reused by another process, told apart by the start time the record
saved; a pid that is no process id; a zombie) is recorded ``interrupted`` with the reason, where there is room to
write it, and reported so either way: ``--wait`` returns. A record this command ends says so (``ended_by``:
``trainer status``): nothing hashed its files when it ended. A record saved in another pid namespace (a run in a
container, :func:`trainer.record.record.unverifiable`) is reported ``running (its process cannot be checked from
here...)`` and never rewritten.

Exit codes: 0 complete, 1 failed or interrupted, 2 bad input, 3 not finished (rendered, submitted, running;
with ``--wait``: still not finished after ``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.record import joblog
from trainer.record.record import effective_status, process_gone, unverifiable
from trainer.record.rundir import FAILED, INTERRUPTED, LOGS, RunDir, read_record, utc_now

ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


ENDED_BY = "trainer status"  # a record's ``ended_by`` when this command, not the run, wrote its end
UNKNOWN = "UNKNOWN"  # Slurm could not be asked (timeout, slurmctld unreachable): keep polling, conclude nothing


def slurm_state(job_id: str) -> str | None:
    """The Slurm job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ...); None when Slurm says it no longer
    knows the job (``Invalid job id``); :data:`UNKNOWN` when Slurm could not be asked."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().split()[0]
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    for word in out.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    if "invalid job id" in (out.stderr + out.stdout).lower():
        return None
    return UNKNOWN


def node_states(nodes: list[str]) -> dict[str, str]:
    """Slurm's state of each node of ``nodes`` (``sinfo -h -N -n NODES -o "%N %T"``: ``idle``, ``allocated``,
    ``down*`` where ``*`` means not responding); {} when Slurm could not be asked."""
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    pairs = (line.split() for line in out.stdout.splitlines())
    return {p[0]: p[1] for p in pairs if len(p) == 2} if out.returncode == 0 else {}


def lost_nodes(run_dir: Path, record: dict[str, Any]) -> str:
    """``"; node(s) n1 lost (down*), with rank(s) 0, 1"``: the job's nodes (``slurm.nodes``) that Slurm says are
    down or not responding (:func:`node_states`), with the ranks the job placed on them (its log's ``rank N:
    node NAME`` lines, :func:`trainer.record.joblog.placement`); "" when none is."""
    listed = (record.get("slurm") or {}).get("nodes") if isinstance(record.get("slurm"), dict) else None
    nodes = [n for n in listed if isinstance(n, str)] if isinstance(listed, list) else []
    states = node_states(nodes) if nodes else {}
    lost = [n for n in nodes if states.get(n, "").endswith("*") or states.get(n, "").startswith(("down", "fail"))]
    if not lost:
        return ""
    placed = joblog.placement(Path(run_dir) / LOGS / "job.log")
    ranks = ", ".join(str(r) for r in sorted(r for r, n in placed.items() if n in lost))
    held = f", with rank(s) {ranks}" if ranks else ""
    return f"; node(s) {', '.join(f'{n} lost ({states[n]})' for n in lost)}{held}"


def refresh(run_dir: Path) -> dict[str, Any]:
    """The run's record, reconciled with Slurm (see the module docstring); raises :class:`UserError` when
    ``run_dir`` has no record."""
    record = read_record(run_dir)
    if record is None:
        raise UserError(f"{run_dir}: no record.json (is it a run directory written by `train`?)")
    status = effective_status(record)
    slurm = record.get("slurm") or {}
    if record.get("launcher") == "slurm" and status in ("submitted", "running") and slurm.get("job_id"):
        state = slurm_state(str(slurm["job_id"]))
        record["slurm"]["state"] = state
        if state in ENDED or state is None:
            time.sleep(1.0)  # the script's last step may be writing the record right now
            record = read_record(run_dir) or record
            if record.get("status") in ("submitted", "running"):
                out = run_dir / LOGS / f"slurm-{slurm['job_id']}.out"
                lines = [line for line in joblog.tail(out).splitlines() if line.strip()]
                tail = f"; last line of {out.name}: {lines[-1].strip()}" if lines else ""
                rundir = RunDir(run_dir)
                rundir.end(
                    record,
                    FAILED,
                    f"Slurm job {slurm['job_id']} ended {state or '(unknown to Slurm)'} "
                    f"before its script recorded a result{lost_nodes(run_dir, record)}{tail}",
                )
                record.setdefault("slurm", {})["state"] = state
                record["ended_by"] = ENDED_BY
                rundir.save_record(record)
    elif record.get("status") == "running" and status != "running":
        # the process the record names is gone (ended, its pid reused, no process id): say so, and record it
        # where there is room (a run that filled its disk may have had none to record how it ended)
        reason = process_gone(record) or "its process is gone"
        rundir = RunDir(run_dir)
        rundir.end(record, INTERRUPTED, f"{reason} (found by `trainer status` at {utc_now()})")
        record["ended_by"] = ENDED_BY
        try:
            rundir.save_record(record)
        except OSError:
            pass
    else:
        record["status"] = status
    return record


def main(argv: list[str]) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="trainer status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--wait", action="store_true", help="follow the run until it is finished")
    parser.add_argument("--timeout", type=float, default=None, help="with --wait: give up after this many seconds")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    args = parser.parse_args(argv)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    last = None
    while True:
        record = refresh(args.run_dir)
        status = record.get("status")
        line = f"{args.run_dir}: {status}"
        if status == "running" and unverifiable(record):  # another pid namespace: reported, never rewritten
            line += " (its process cannot be checked from here: another pid namespace)"
        if record.get("slurm", {}).get("job_id"):
            line += (
                f" (Slurm job {record['slurm']['job_id']}"
                + (f", {record['slurm']['state']}" if record["slurm"].get("state") else "")
                + ")"
            )
        if record.get("reason"):
            line += f": {record['reason']}"
        if not args.json and line != last:
            print(line, flush=True)
            last = line
        finished = status in ("complete", "failed", "interrupted")
        if finished or not args.wait or (deadline is not None and time.monotonic() > deadline):
            break
        time.sleep(2.0)
    if args.json:
        print(json.dumps(record, indent=2, sort_keys=True))
    return {"complete": 0, "failed": 1, "interrupted": 1}.get(str(status), 3)
