"""The attempts of a run: what a ``--resume`` continues from and how the record links the attempts before it.

A run that ended (``complete``, ``failed``, ``interrupted``) and is resumed into the same directory becomes an
earlier attempt: its ``record.json`` (with ``attestation.json`` and ``metrics.jsonl``) is kept as
``attempts/N/``, and the new record lists it in ``attempts`` by sha256 and names the checkpoint it continues
from in ``resumed_from``. The checkpoint (the CPU worker's, :mod:`trainer.launch.checkpoint`, Megatron's layout)
is the one the tracker names, its bytes equal to the sha256 the earlier record holds for it: the record is what
vouches for it, and this side never unpickles it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.publish import atomic_write
from trainer.record.names import ATTEMPTS, ATTESTATION, CHECKPOINTS, METRICS, RECORD, checkpoint_state
from trainer.record.rundir import FINAL, read_record

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's tracker file: the newest iteration, as decimal text


def latest_iteration(run_dir: Path) -> int:
    """The iteration the tracker names, 0 when there is no tracker. Raises :class:`UserError` naming the
    tracker when it holds anything but a positive decimal iteration."""
    tracker = Path(run_dir) / CHECKPOINTS / TRACKER
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{tracker}: not readable ({err})") from None
    if not text.isdigit() or int(text) < 1:
        raise UserError(
            f"{tracker}: expected the iteration of the latest checkpoint (a positive integer), got {text[:40]!r}"
        )
    return int(text)


def vouched_checkpoint(run_dir: Path, files_sha256: dict[str, str], where: str) -> tuple[int, str | None]:
    """``(iteration, sha256)`` of the checkpoint a ``--resume`` of ``run_dir`` starts from: the tracker's,
    its file's bytes equal to the sha256 that ``files_sha256`` (the previous attempt's record) holds for it;
    ``(0, None)`` when there is no tracker (the run starts again from step 1). Raises :class:`UserError` naming
    ``where`` and the file when the record holds no hash for it or its bytes changed since."""
    import hashlib

    iteration = latest_iteration(run_dir)
    if iteration == 0:
        return 0, None
    rel = checkpoint_state(iteration)
    expected = files_sha256.get(rel) if isinstance(files_sha256, dict) else None
    if not isinstance(expected, str):
        raise UserError(
            f"{where}: {rel} is not in the previous attempt's record (files_sha256): nothing vouches for it; "
            "--overwrite to start the run again"
        )
    digest = hashlib.sha256()
    try:
        with open(Path(run_dir) / rel, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    except OSError as err:
        raise UserError(f"{where}: {rel}: not readable ({err.strerror})") from None
    if digest.hexdigest() != expected:
        raise UserError(
            f"{where}: {rel} changed since the previous attempt recorded it (sha256 {digest.hexdigest()[:16]}..., "
            f"recorded {expected[:16]}...): refusing to resume from it"
        )
    return iteration, expected


def ended_attempt(run_dir: Path) -> dict[str, Any] | None:
    """The record of the ended attempt (``complete``, ``failed`` or ``interrupted``) that a ``--resume`` of
    ``run_dir`` continues, its latest checkpoint vouched for (:func:`vouched_checkpoint`); None when the
    directory holds no such record (a plan, a run handed to a scheduler: written over as before). ``train``
    asks before anything is written (Hydra's files included). Raises :class:`UserError` (one line)."""
    previous = read_record(Path(run_dir))
    if not previous or previous.get("status") not in FINAL:
        return None
    vouched_checkpoint(run_dir, previous.get("files_sha256") or {}, f"{run_dir} (--resume)")
    return dict(previous)


def continue_attempt(run_dir: Path, previous: dict[str, Any]) -> dict[str, Any]:
    """Before a ``--resume`` writes into ``run_dir``: keep the ended attempt ``previous`` (its ``record.json``) and
    set the directory to continue it from its latest checkpoint. Returns the new record's fields ``attempts``
    (every earlier attempt, this one last: ``{"attempt", "status", "reason", "record", "record_sha256",
    "steps_written", "resumed_from_iteration", "checkpoint_sha256"}``) and ``resumed_from`` (``{"attempt",
    "iteration", "checkpoint", "sha256"}``; iteration 0: from the start).

    The checkpoint is the tracker's, its bytes checked against the previous record (:func:`vouched_checkpoint`)
    first; then ``record.json``, ``attestation.json`` and ``metrics.jsonl`` are copied to ``attempts/N/``
    (written under a temporary name, renamed), and ``metrics.jsonl`` keeps the rows of the steps the checkpoint
    holds (``step <= iteration``): the resumed workers append the rest. Raises :class:`UserError` (one line
    naming the file) when the checkpoint is not vouched for or a metrics row is not a step's; nothing is changed
    then."""
    import hashlib
    import json

    run_dir = Path(run_dir)
    where = f"{run_dir} (--resume)"
    iteration, checkpoint_sha = vouched_checkpoint(run_dir, previous.get("files_sha256") or {}, where)
    metrics = run_dir / METRICS
    lines = metrics.read_text().splitlines(keepends=True) if metrics.is_file() else []
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{metrics}:{number}: not a step's row (a JSON object with a step)") from None
        if isinstance(step, int) and step <= iteration:
            kept.append(line)
    earlier = [a for a in previous.get("attempts") or [] if isinstance(a, dict)]
    number = len(earlier) + 1
    target = run_dir / ATTEMPTS / str(number)
    if target.exists():
        raise UserError(f"{target}: exists, but the record lists {len(earlier)} earlier attempts; --overwrite")
    target.parent.mkdir(parents=True, exist_ok=True)
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
    }
    resumed = {
        "attempt": number,
        "iteration": iteration,
        "checkpoint": checkpoint_state(iteration) if iteration else None,
        "sha256": checkpoint_sha,
    }
    return {"attempts": [*earlier, entry], "resumed_from": resumed}
