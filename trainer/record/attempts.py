"""The attempts of a run: what a ``--resume`` continues from and how the record links the attempts before it.

A run that ended (``complete``, ``failed``, ``interrupted``, or ``running`` in a record whose process is gone:
killed before it could say so) and is resumed into the same directory becomes an earlier attempt: its
``record.json`` (with ``attestation.json`` and ``metrics.jsonl``) is kept as ``attempts/N/``, and the new record
lists it in ``attempts`` by sha256 and names the checkpoint it continues from in ``resumed_from``. The checkpoint
(the CPU worker's, :mod:`trainer.launch.checkpoint`, Megatron's layout) is the one the tracker names, the
tracker's bytes and the checkpoint's equal to the sha256 the earlier record holds for them: the record is what
vouches for it, and this side never unpickles it. A record that holds no checkpoint's hash (its run ended before
the record could hash them: the launcher killed, a Slurm job's first node lost) leaves the voucher to the worker
that saved it: the sha256 file it wrote beside the checkpoint as it saved it, the tracker's bytes exactly the
iteration and a newline, as a save writes them. The worker then loads only the checkpoint the new record's
``resumed_from`` names, its bytes checked again against that sha256 (:func:`trainer.launch.checkpoint.load`).

What that guards against: a checkpoint, tracker or metrics row changed, swapped or damaged after the attempt's
record was sealed, by accident or by anyone who leaves the record as it was. The record itself is a file of the
run directory: one rewritten with the hashes of forged files passes these checks. What catches that is the
signature: ``trainer verify RUN --key PUB`` checks a signed run's ``attestation.json`` (a DSSE envelope whose
subject lists the sha256 of every file, record.json included: :mod:`trainer.record.attest`), and the attempts
kept under ``attempts/N/`` keep their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.inputs import read_bytes
from trainer.publish import atomic_write
from trainer.record.names import (
    ATTEMPTS,
    ATTESTATION,
    CHECKPOINTS,
    METRICS,
    RECORD,
    checkpoint_state,
    checkpoint_state_sha256,
)
from trainer.record.record import process_gone, sha256_file
from trainer.record.rundir import FINAL, INTERRUPTED, RUNNING, read_record
from trainer.record.status import ENDED, refresh, slurm_state

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's tracker file: the newest iteration, as decimal text
TRACKER_PATH = f"{CHECKPOINTS}/{TRACKER}"  # the tracker relative to the run directory, as files_sha256 names it
ITERATION = re.compile(r"[0-9]{1,9}")  # an iteration as the tracker and a record write it: ASCII digits, 9 at most
# an iteration's state under checkpoints/ as trainer.record.names.checkpoint_state names it (7 digits, zero-padded;
# more for iterations from 10,000,000 on, up to ITERATION's 9); the temporary folder of a save a kill interrupted
# (``.iter_NNNNNNN.XXXX``) is none
STATE = re.compile(r"iter_(?:[0-9]{7}|[1-9][0-9]{7,8})/mp_rank_00/model_optim_rng\.pt")
MAX_TRACKER_BYTES = 4096  # a tracker holds one iteration and a newline; larger is not one a save wrote
WRITTEN_SHA256 = re.compile(rb"([0-9a-f]{64})  model_optim_rng\.pt\n")  # the line a save writes beside its state


def latest_iteration(run_dir: Path) -> int:
    """The iteration the tracker names, 0 when there is no tracker (:func:`read_tracker`). Raises
    :class:`UserError` naming the tracker when it is not a regular file of at most 4 KiB, or holds anything but a
    positive decimal iteration of at most 9 ASCII digits."""
    return read_tracker(run_dir)[0]


def read_tracker(run_dir: Path) -> tuple[int, bytes | None]:
    """``(iteration, bytes)`` of ``run_dir``'s tracker ``checkpoints/latest_checkpointed_iteration.txt``:
    ``(0, None)`` when there is none. The iteration is the text stripped of white space, ASCII digits only
    (``re.fullmatch("[0-9]{1,9}")``: not ``str.isdigit``, which takes ``"²"``), at least 1. Raises
    :class:`UserError` (one line naming the tracker) otherwise, or when it is unreadable, not a regular file or
    larger than :data:`MAX_TRACKER_BYTES`."""
    tracker = Path(run_dir) / TRACKER_PATH
    try:
        data = read_bytes(tracker, "checkpoint tracker", MAX_TRACKER_BYTES)
    except FileNotFoundError:
        if tracker.is_symlink():  # a dangling link is no missing tracker
            raise UserError(f"{tracker}: a symbolic link to nothing, not the checkpoint tracker") from None
        return 0, None
    except OSError as err:
        raise UserError(f"{tracker}: not readable ({err.strerror or err})") from None
    text = data.decode("utf-8", "replace").strip()
    if not ITERATION.fullmatch(text) or int(text) < 1:
        raise UserError(
            f"{tracker}: expected the iteration of the latest checkpoint (a positive integer of at most 9 digits), "
            f"got {text[:40]!r}"
        )
    return int(text), data


def unsealed(record: dict[str, Any] | None) -> bool:
    """Whether ``record`` (as its file holds it) ended without its run hashing its files: it still says
    ``running`` (its process gone: :func:`ended_attempt`), or `trainer status` wrote its end (``ended_by``: a
    Slurm job that ended before its script recorded a result, as when its first node was lost; a local run whose
    process was gone)."""
    record = record if isinstance(record, dict) else {}
    return record.get("status") == RUNNING or record.get("ended_by") == "trainer status"


def _linked_record(run_dir: Path, attempt: dict[str, Any]) -> dict[str, Any]:
    """The earlier attempt's record that ``attempt`` (an ``attempts`` entry) links, parsed, after its bytes are
    checked against the entry's ``record_sha256``; raises :class:`UserError` naming it otherwise."""
    copy = attempt.get("record")
    if not isinstance(copy, str) or not copy.startswith(f"{ATTEMPTS}/") or ".." in Path(copy).parts:
        raise UserError(f"{run_dir}: an attempt links {copy!r}, not a record under {ATTEMPTS}/: --overwrite")
    path = run_dir / copy
    digest = None if linked(run_dir, copy) else _digest(path)
    if digest is None or digest != attempt.get("record_sha256"):
        raise UserError(
            f"{path}: missing, a link, unreadable or not of the sha256 the record links: the earlier attempt's "
            "hashes cannot be read from it; --overwrite"
        )
    try:
        kept = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not a record ({err})") from None
    return kept if isinstance(kept, dict) else {}


def known_hashes(run_dir: Path, record: dict[str, Any]) -> dict[str, str]:
    """The sha256 of checkpoint files (relative paths under ``checkpoints/``) that ``record`` and the attempts
    before it hold: the checkpoint its ``resumed_from`` names, each attempt's ``checkpoint_sha256``, and the
    ``files_sha256`` of each earlier attempt's record kept under ``attempts/N/``, its bytes of the sha256 the entry
    links (``record_sha256``). A save's own sha256 file must agree with every one of them. Raises
    :class:`UserError` naming a kept record that is missing, a link, unreadable or not of that sha256: an edited
    or removed record would otherwise drop the hashes it binds."""
    known: dict[str, str] = {}
    for attempt in record.get("attempts") or []:
        if not isinstance(attempt, dict):
            continue
        kept = _linked_record(run_dir, attempt)
        files = kept.get("files_sha256")
        for rel, digest in (files if isinstance(files, dict) else {}).items():
            if isinstance(rel, str) and rel.startswith(f"{CHECKPOINTS}/") and isinstance(digest, str):
                known[rel] = digest
        iteration, digest = attempt.get("resumed_from_iteration"), attempt.get("checkpoint_sha256")
        if type(iteration) is int and iteration > 0 and isinstance(digest, str):
            known[checkpoint_state(iteration)] = digest
    resumed = record.get("resumed_from")
    resumed = resumed if isinstance(resumed, dict) else {}
    if isinstance(resumed.get("checkpoint"), str) and isinstance(resumed.get("sha256"), str):
        known[resumed["checkpoint"]] = resumed["sha256"]
    return known


def written_sha256(run_dir: Path, iteration: int) -> str | None:
    """The sha256 (64 lowercase hex digits) that the save of ``iteration`` wrote beside its checkpoint
    (:func:`trainer.record.names.checkpoint_state_sha256`: one ``sha256sum`` line, :data:`WRITTEN_SHA256`);
    None when that file is missing, unreadable, over 4 KiB, reached through a symbolic link (:func:`linked`) or
    not that one line. Raises nothing."""
    sums = checkpoint_state_sha256(iteration)
    if linked(run_dir, sums):
        return None
    try:
        line = read_bytes(Path(run_dir) / sums, "checkpoint sha256 file", MAX_TRACKER_BYTES)
    except (OSError, UserError):
        return None
    written = WRITTEN_SHA256.fullmatch(line)
    return written.group(1).decode() if written else None


def linked(run_dir: Path, rel: str) -> bool:
    """Whether any part of ``rel`` below ``run_dir`` (a folder on the way, or the file) is a symbolic link."""
    path = Path(run_dir)
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            return True
    return False


def vouched_by(record: dict[str, Any] | None) -> str:
    """Who vouches for the checkpoints of the ended attempt ``record`` (as its file holds it): ``"writer"`` for
    one :func:`unsealed` that holds no hash of any file under ``checkpoints/`` (the sha256 file each save wrote
    beside its state: :func:`vouched_checkpoint`), else ``"record"``."""
    files = (record or {}).get("files_sha256") if isinstance(record, dict) else None
    files = files if isinstance(files, dict) else {}
    hashed = any(rel.startswith(f"{CHECKPOINTS}/") for rel in files)
    return "writer" if unsealed(record) and not hashed else "record"


def vouched_checkpoint(
    run_dir: Path,
    files_sha256: dict[str, str],
    where: str,
    voucher: str = "record",
    record: dict[str, Any] | None = None,
) -> tuple[int, str | None]:
    """``(iteration, sha256)`` of the checkpoint a ``--resume`` of ``run_dir`` starts from: the tracker's
    (:func:`read_tracker`), the tracker's bytes and its checkpoint file's equal to the sha256 that ``files_sha256``
    (the previous attempt's record) holds for each; ``(0, None)`` when there is no tracker and the record holds
    none (the run starts again from step 1). With ``voucher`` ``"writer"`` (:func:`vouched_by`: the record
    ended unsealed and holds no checkpoint's hash) the worker that saved it vouches instead: the tracker's bytes
    exactly ``ITERATION\n``, the checkpoint's sha256 the one its ``.sha256`` file holds, and neither older than
    the checkpoint ``record`` (the previous attempt's, as its file holds it) resumed from nor other than any hash
    ``record`` or the attempts before it hold for it (:func:`_written`, :func:`known_hashes`). Raises
    :class:`UserError` naming ``where`` and the file when nothing vouches for it, its bytes changed since, or the
    tracker is gone while the record holds it, resumed from a step after 0 or more than one checkpoint was saved
    (a save writes its state, then the tracker); and :func:`read_tracker`'s for a tracker that names no
    iteration."""
    files = files_sha256 if isinstance(files_sha256, dict) else {}
    iteration, tracker = read_tracker(run_dir)
    if tracker is not None and voucher == "writer":
        return iteration, _written(Path(run_dir), iteration, tracker, where, record or {})
    if tracker is None:
        if isinstance(files.get(TRACKER_PATH), str):
            raise UserError(
                f"{where}: {TRACKER_PATH} is gone, but the previous attempt's record holds it: refusing to resume "
                "from the start; --overwrite to start the run again"
            )
        started = _started(record or {})
        if started > 0:
            raise UserError(
                f"{where}: {TRACKER_PATH} is gone, but the previous attempt resumed from step {started}: refusing "
                "to resume from the start; --overwrite to start the run again"
            )
        states = [rel for rel in resume_inputs(Path(run_dir)) if STATE.fullmatch(rel.removeprefix(f"{CHECKPOINTS}/"))]
        if len(states) > 1:  # a save writes the tracker after its state: a second save followed a tracker
            raise UserError(
                f"{where}: {TRACKER_PATH} is gone, but {len(states)} checkpoints were saved ({states[-1]} the "
                "last): refusing to resume from the start; --overwrite to start the run again"
            )
        return 0, None
    _vouched(TRACKER_PATH, hashlib.sha256(tracker).hexdigest(), files, where)
    rel = checkpoint_state(iteration)
    try:
        digest = sha256_file(Path(run_dir) / rel)
    except OSError as err:
        raise UserError(f"{where}: {rel}: not readable ({err.strerror or err})") from None
    if digest is None:
        raise UserError(f"{where}: {rel}: missing (the tracker names iteration {iteration})")
    return iteration, _vouched(rel, digest, files, where)


def _started(record: dict[str, Any]) -> int:
    """The iteration ``record``'s attempt resumed from (``resumed_from.iteration``); 0 for none."""
    resumed = record.get("resumed_from")
    started = resumed.get("iteration") if isinstance(resumed, dict) else None
    return started if isinstance(started, int) and not isinstance(started, bool) and started > 0 else 0


def _written(run_dir: Path, iteration: int, tracker: bytes, where: str, record: dict[str, Any]) -> str:
    """The sha256 of ``iteration``'s checkpoint file as the worker that saved it wrote it beside it
    (:func:`trainer.record.names.checkpoint_state_sha256`, one ``sha256sum`` line in a regular file reached
    without a symbolic link), the file's bytes equal to it, ``tracker`` the bytes a save writes, ``iteration`` not
    older than the one ``record`` resumed from, and the sha256 no other than any :func:`known_hashes` holds for
    the file. Raises :class:`UserError` naming ``where`` and the file otherwise."""
    if tracker != f"{iteration}\n".encode():
        raise UserError(
            f"{where}: {TRACKER_PATH} holds {tracker[:40]!r}, not the iteration and a newline as a save writes it, "
            "and the previous attempt's record holds no hash of it: nothing vouches for it; --overwrite"
        )
    started = _started(record)
    if iteration < started:
        raise UserError(
            f"{where}: {TRACKER_PATH} names iteration {iteration}, older than the {started} the previous attempt "
            "resumed from: refusing to resume from it"
        )
    rel, sums = checkpoint_state(iteration), checkpoint_state_sha256(iteration)
    expected = written_sha256(run_dir, iteration)
    if expected is None:
        raise UserError(
            f"{where}: {rel}: neither the previous attempt's record nor a sha256 file its save wrote "
            f"({sums}) vouches for it; --overwrite to start the run again"
        )
    digest = None if linked(run_dir, rel) else _digest(run_dir / rel)
    if digest is None:
        raise UserError(f"{where}: {rel}: missing, unreadable or a link (the tracker names iteration {iteration})")
    if digest != expected:
        raise UserError(
            f"{where}: {rel} changed since its save wrote {sums} (sha256 {digest[:16]}..., written "
            f"{expected[:16]}...): refusing to resume from it"
        )
    held = known_hashes(run_dir, record).get(rel, expected)
    if held != expected:
        raise UserError(
            f"{where}: {rel} is not the one an earlier attempt recorded (sha256 {expected[:16]}..., recorded "
            f"{held[:16]}...): refusing to resume from it; if the last attempt saved it anew, nothing can tell that "
            f"from a swap: write {started} (the step it resumed from) to {TRACKER_PATH} to resume from there, or "
            "--overwrite"
        )
    return expected


def _vouched(rel: str, digest: str, files: dict[str, str], where: str) -> str:
    """``digest`` (the sha256 of the file ``rel`` of the run directory, as it is) when ``files`` (the previous
    attempt's ``files_sha256``) holds the same for it. Raises :class:`UserError` naming ``where`` and ``rel``
    otherwise."""
    expected = files.get(rel)
    if not isinstance(expected, str):
        raise UserError(
            f"{where}: {rel} is not in the previous attempt's record (files_sha256): nothing vouches for it; "
            "--overwrite to start the run again"
        )
    if digest != expected:
        raise UserError(
            f"{where}: {rel} changed since the previous attempt recorded it (sha256 {digest[:16]}..., "
            f"recorded {expected[:16]}...): refusing to resume from it"
        )
    return expected


def resume_inputs(run_dir: Path) -> list[str]:
    """The files a ``--resume`` of ``run_dir`` relies on, relative POSIX paths, sorted: ``metrics.jsonl``, the
    tracker and each iteration's state (:data:`STATE`). Only regular files reached without a symbolic link count
    (nothing vouches for what a link points to)."""
    found = [name for name in (METRICS, TRACKER_PATH) if _digest(run_dir / name) is not None]
    top = run_dir / CHECKPOINTS
    if top.is_dir() and not top.is_symlink():
        for folder, _, files in os.walk(top):  # does not descend into linked folders
            for name in files:
                path = Path(folder) / name
                if STATE.fullmatch(path.relative_to(top).as_posix()) and path.is_file() and not path.is_symlink():
                    found.append(path.relative_to(run_dir).as_posix())
    return sorted(found)


def vouch_for_resume(run_dir: Path, record: dict[str, Any]) -> list[str]:
    """Add to ``record["files_sha256"]`` the sha256 (streamed) of each of :func:`resume_inputs` that it does not
    list yet, as the files are now: for a record that its run's job ends itself (a Slurm job,
    :func:`trainer.launch.jobsteps.mark`), so that a ``--resume`` after it has a record that vouches for its
    checkpoint (:func:`vouched_checkpoint`). An iteration's state that an earlier attempt holds
    (:func:`known_hashes`) with other bytes (changed while the job waited; its worker then refused it) is left
    out, so that it stays refused, and so is every state when an earlier attempt's kept record is not the one its
    entry links; the tracker and ``metrics.jsonl`` move on with each attempt. Returns the states left out."""
    files = record.setdefault("files_sha256", {})
    try:
        earlier: dict[str, str] | None = known_hashes(run_dir, record)
    except UserError:  # an earlier attempt's kept record changed: none of its bindings can be read, none is vouched
        earlier = None
    refused = []
    for rel in resume_inputs(run_dir):
        digest = None if rel in files else sha256_file(run_dir / rel)
        if digest is None:
            continue
        if rel.startswith(f"{CHECKPOINTS}/iter_") and (earlier is None or earlier.get(rel, digest) != digest):
            refused.append(rel)
        else:
            files[rel] = digest
    return refused


def ended_attempt(run_dir: Path) -> dict[str, Any] | None:
    """The record of the ended attempt that a ``--resume`` of ``run_dir`` continues, its latest checkpoint vouched
    for (:func:`vouched_checkpoint`): one that ended (``complete``, ``failed`` or ``interrupted``), or one still
    saying ``running`` whose process is gone (:func:`trainer.record.record.process_gone`: killed before it could
    say so), returned as ``interrupted`` with that reason. A Slurm job's record that says ``running`` is first
    reconciled with Slurm (:func:`trainer.record.status.refresh`, as ``trainer status`` does): a job Slurm says
    has ended (its first node lost: the script that records the end died with it) is recorded ``failed``. Such
    records ended before their run hashed its files (:func:`unsealed`): the sha256 files the saves wrote vouch
    for the checkpoints (:func:`vouched_by`). None when the directory holds no such record (a plan, a run handed
    to a scheduler: written over as before). ``train`` asks before it writes anything (Hydra's files included);
    the one write here is that end of a Slurm job, saved as ``trainer status`` would save it. Raises
    :class:`UserError` (one line) for a ``running`` record whose process or Slurm job may still run (on this
    host, another one, or in another pid namespace; a job Slurm does not know), and :func:`vouched_checkpoint`'s."""
    previous = read_record(Path(run_dir))
    if not previous:
        return None
    where = f"{run_dir} (--resume)"
    status = previous.get("status")
    job = (previous.get("slurm") or {}).get("job_id") if isinstance(previous.get("slurm"), dict) else None
    if status == RUNNING and previous.get("launcher") == "slurm" and job:
        state = slurm_state(str(job))
        if state not in ENDED:  # running, pending, unknown to Slurm (another SLURM_CONF?) or Slurm not answering
            raise UserError(
                f"{where}: its {RECORD} says {status} and its Slurm job {job} is {state or 'unknown to Slurm'}: "
                "wait for it to end, or scancel it, before resuming"
            )
        previous = refresh(Path(run_dir))  # records the end Slurm saw, as `trainer status` does
        status = previous.get("status")
    if status == RUNNING:
        gone = process_gone(previous)
        if gone is None:
            pid, host = previous.get("pid"), str(previous.get("host"))[:80]
            who = f"pid {pid} on {host}" if isinstance(pid, int) else f"on {host}, no pid recorded: a scheduler's job"
            raise UserError(
                f"{where}: its {RECORD} says running ({who}) and that process may still run: wait for it to end, "
                "or stop it, before resuming"
            )
        previous = {**previous, "status": INTERRUPTED, "reason": f"{gone} (its {RECORD} still said running)"}
    elif status not in FINAL:
        return None
    on_disk = read_record(Path(run_dir)) or {}
    vouched_checkpoint(run_dir, previous.get("files_sha256") or {}, where, vouched_by(on_disk), on_disk)
    return dict(previous)


def continue_attempt(run_dir: Path, previous: dict[str, Any]) -> dict[str, Any]:
    """Before a ``--resume`` writes into ``run_dir``: keep the ended attempt ``previous`` (its ``record.json``,
    :func:`ended_attempt`) and set the directory to continue it from its latest checkpoint. Returns the new
    record's fields ``attempts`` (every earlier attempt, this one last: ``{"attempt", "status", "reason", "record",
    "record_sha256", "steps_written", "resumed_from_iteration", "checkpoint_sha256", "checkpoint_vouched_by"}``,
    the last :func:`vouched_by`'s word) and ``resumed_from``
    (``{"attempt", "iteration", "checkpoint", "sha256"}``; iteration 0: from the start).

    The checkpoint is the tracker's, its bytes checked against the previous record (:func:`vouched_checkpoint`)
    first; then ``record.json``, ``attestation.json`` and ``metrics.jsonl`` are copied to ``attempts/N/``
    (written under a temporary name, renamed), and ``metrics.jsonl`` keeps the rows of the steps the checkpoint
    holds (``step <= iteration``; :func:`kept_rows`): the resumed workers append the rest. An ``attempts/N/``
    left by a ``--resume`` killed before its new record was saved (its ``record.json`` byte for byte the one
    in the run directory) is that copy: taken as it is, its ``metrics.jsonl`` the rows the attempt wrote. Raises
    :class:`UserError` (one line naming the file) when the checkpoint is not vouched for, a metrics row is not a
    step's, or ``attempts/N`` holds anything else; nothing is changed then."""
    run_dir = Path(run_dir)
    where = f"{run_dir} (--resume)"
    on_disk = read_record(run_dir) or {}
    voucher = vouched_by(on_disk)
    files = previous.get("files_sha256") or {}
    iteration, checkpoint_sha = vouched_checkpoint(run_dir, files, where, voucher, on_disk)
    earlier = [a for a in previous.get("attempts") or [] if isinstance(a, dict)]
    number = len(earlier) + 1
    target = run_dir / ATTEMPTS / str(number)
    leftover = _leftover(run_dir, target, len(earlier), previous.get("files_sha256") or {}, voucher, iteration)
    metrics = run_dir / METRICS
    lines, kept = kept_rows(target / METRICS if leftover else metrics, iteration)
    if not leftover:
        _keep_attempt(run_dir, target, number)
    if kept:
        atomic_write(metrics, "".join(kept).encode())
    else:
        metrics.unlink(missing_ok=True)
    entry = {
        "attempt": number,
        "status": previous.get("status"),
        "reason": previous.get("reason"),
        "record": f"{ATTEMPTS}/{number}/{RECORD}",
        "record_sha256": hashlib.sha256((target / RECORD).read_bytes()).hexdigest(),
        "steps_written": len(lines),
        "resumed_from_iteration": iteration,
        "checkpoint_sha256": checkpoint_sha,
        "checkpoint_vouched_by": voucher if iteration else None,
    }
    resumed = {
        "attempt": number,
        "iteration": iteration,
        "checkpoint": checkpoint_state(iteration) if iteration else None,
        "sha256": checkpoint_sha,
    }
    return {"attempts": [*earlier, entry], "resumed_from": resumed}


def _leftover(
    run_dir: Path, target: Path, listed: int, files_sha256: dict[str, Any], voucher: str, iteration: int
) -> bool:
    """Whether ``target`` (``attempts/N``) is the copy of this attempt that a ``--resume`` killed before its new
    record left: a real folder whose ``record.json`` is byte for byte ``run_dir``'s, whose ``metrics.jsonl`` (where
    present) has the sha256 that record's ``files_sha256`` holds (the copy was made before the run's was cut to
    the checkpoint's steps; one the record holds no hash for is refused: nothing vouches for its rows; except
    where the record ended unsealed, ``voucher`` ``"writer"``, and hashes no metrics at all: then the run's
    ``metrics.jsonl`` must be the copy, or the copy's rows up to ``iteration``, as the cut leaves it) and whose
    ``attestation.json`` is byte for byte ``run_dir``'s (any regular file where the run's is gone: the new
    attempt's plan removes it); either copy missing where the run had one to copy is refused (the copy is made
    whole, then renamed). False when there is none. Raises
    :class:`UserError` naming it when it holds anything else."""
    if not (target.exists() or target.is_symlink()):
        return False
    kept, current = target / RECORD, run_dir / RECORD
    same = (
        not target.is_symlink()
        and target.is_dir()
        and not kept.is_symlink()
        and kept.is_file()
        and kept.read_bytes() == current.read_bytes()
    )
    if not same:
        raise UserError(
            f"{target}: exists, but the record lists {listed} earlier attempts and {target.name}/{RECORD} is not "
            "the run's record.json; --overwrite"
        )
    metrics_now = run_dir / METRICS
    attestation_now = _digest(run_dir / ATTESTATION)
    had_metrics = METRICS in files_sha256 or metrics_now.exists() or metrics_now.is_symlink()
    copies = (  # (name, the sha256 it must have, whether the run had one to copy)
        (METRICS, files_sha256.get(METRICS), had_metrics),
        (ATTESTATION, attestation_now, attestation_now is not None),
    )
    for name, want, had in copies:
        copy = target / name
        if not (copy.exists() or copy.is_symlink()):
            if not had:
                continue
            raise UserError(f"{copy}: missing, but the run's {name} was there to copy; --overwrite")
        digest = _digest(copy)
        if name == METRICS and want is None and voucher == "writer" and digest is not None:
            if _cut_from(metrics_now, copy, iteration):
                continue
        if name == ATTESTATION and want is None and digest is not None:
            continue  # the run's was removed after the copy: the new attempt's plan is written without one
        if digest is None or digest != want:
            raise UserError(f"{copy}: not the run's {name} (its record's files_sha256, its attestation); --overwrite")
    return True


def _cut_from(metrics: Path, copy: Path, iteration: int) -> bool:
    """Whether the run's ``metrics`` (absent: no rows) holds the bytes of ``copy`` or of its rows up to
    ``iteration`` (:func:`kept_rows`): the run's file as a resume copies it, before or after it cuts it."""
    if metrics.is_symlink() or (metrics.exists() and not metrics.is_file()):
        return False
    now = metrics.read_bytes() if metrics.exists() else b""
    return now == copy.read_bytes() or now == "".join(kept_rows(copy, iteration)[1]).encode()


def _digest(path: Path) -> str | None:
    """sha256 hex of a regular file that is no symbolic link, else None (absent, a link, unreadable)."""
    try:
        return sha256_file(path) if path.is_file() and not path.is_symlink() else None
    except OSError:
        return None


def _keep_attempt(run_dir: Path, target: Path, number: int) -> None:
    """Copy ``run_dir``'s ``record.json``, ``attestation.json`` and ``metrics.jsonl`` into ``target``
    (``attempts/N``): into a temporary folder, renamed. The temporary folders of an earlier copy of attempt
    ``number`` that was killed midway are removed first. Raises ``OSError`` from the file system."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for entry in target.parent.iterdir():  # mkdtemp's names: the prefix, then 8 characters
        if re.fullmatch(rf"\.{number}\.[A-Za-z0-9_]{{8}}", entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
    staging = Path(tempfile.mkdtemp(prefix=f".{number}.", dir=target.parent))
    try:
        for name in (RECORD, ATTESTATION, METRICS):
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, staging / name)
        staging.chmod(0o755)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def kept_rows(metrics: Path, iteration: int) -> tuple[list[str], list[str]]:
    """``(rows, kept)`` of the metrics file ``metrics`` (none when it is missing): every row the attempt wrote
    (an unterminated last line, the half of a row a kill cut short, is no row: dropped) and those of the steps a
    checkpoint of ``iteration`` holds (``step <= iteration``), each line ending in a newline. Raises
    :class:`UserError` naming the file and line for a line that is not a JSON object with an integer ``step``."""
    try:
        lines = metrics.read_text().splitlines(keepends=True) if metrics.is_file() else []
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{metrics}: not readable ({err})") from None
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # a row cut short: the workers write a row and its newline in one write
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise UserError(f"{metrics}:{number}: not a step's row (a JSON object with an integer step)")
        if step <= iteration:
            kept.append(line)
    return lines, kept
