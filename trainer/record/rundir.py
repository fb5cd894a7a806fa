"""The run directory: its file names, its record's states, how it is written (:class:`RunDir`) and read.

A run directory is what ``train`` writes (``hydra.run.dir=DIR``) plus, once the run has executed,
``metrics.jsonl``. Reports accept a directory or, where only the steps matter, a ``metrics.jsonl`` file.

``record.json`` moves through the states ``planned`` (a plan run: nothing launched) or ``running`` -> then
``rendered`` / ``submitted`` (handed off: the run now belongs to a scheduler, and the job writes its own
``running`` -> final states, :mod:`trainer.launch.jobsteps`) or a final state, ``complete``, ``failed`` or
``interrupted`` (:data:`FINAL`). Every change of state goes through :meth:`RunDir.move` (:meth:`RunDir.hand_off`,
:meth:`RunDir.end`), which refuses a move :data:`MOVES` does not list; every write of the record through
:meth:`RunDir.save_record`. The launchers get the run's one :class:`RunDir` and write every file through it
(atomic, hashed into ``files_sha256``); only what the workers write is hashed after them
(:meth:`RunDir.hash_written`). The file names are :mod:`trainer.record.names`'s, re-exported here (the launchers,
workers and reports import them from this module); the run's attestation, written when it is sealed
(:meth:`RunDir.seal`), is :mod:`trainer.record.attest`'s.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.compose import schema
from trainer.compose.checks import check_values
from trainer.errors import UserError, os_error_line
from trainer.inputs import read_json, read_yaml, reading
from trainer.publish import atomic_file, atomic_write, canonical_json
from trainer.record.attest import run_files, write_run_attestation
from trainer.record.names import (
    ARGV,
    ATTEMPTS,
    ATTESTATION,
    CHECKPOINTS,
    COMMAND,
    CONFIG,
    ENV,
    JOB,
    LOGS,
    MEGATRON,
    METRICS,
    PLAN,
    PREFLIGHT,
    PROBES,
    PROFILE,
    RECORD,
    RUNTIME_ENV,
    SANDBOX,
    SBATCH,
    SUBMIT,
)
from trainer.record.names import probe_rank as probe_rank  # re-exported: the workers name their probe files by it
from trainer.record.record import RunRecordFields, effective_status, launcher_record, process_identity
from trainer.redact import OVERLAP, Redactor, _apply, _last_words, redact_env, redact_value, redactor_for

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun
    from trainer.record.record import RunRecord

# argv.json and env.json are the miles launch of every run (as command.sh; executed or not), written once, before
# any launch; job.json is what a launcher runs or submits (RunDir.write_job). The launchers write through RunDir
# (hashed as written); the files the workers write are hashed once the launch has handed back.
WORKER_FILES = (METRICS,)
# Folders of a run directory that hold verbatim copies of content verified by digest (a local-image run's stamped
# lock, image/lock.json) or binary state a later attempt verifies by digest and loads (the CPU worker's
# checkpoints): the secret sweep never rewrites them, so the hashes that cover them stay true.
VERBATIM = ("image", CHECKPOINTS)


# The states of record.json.
PLANNED, RUNNING, COMPLETE, FAILED, INTERRUPTED = "planned", "running", "complete", "failed", "interrupted"
RENDERED, SUBMITTED = "rendered", "submitted"
HANDED_OFF = (RENDERED, SUBMITTED)  # the run now belongs to a scheduler (rendered for it, or accepted by it)
FINAL = (COMPLETE, FAILED, INTERRUPTED)
# The moves a record's state may make (:meth:`RunDir.move`): a plan is launched, a launch hands off or ends, a
# job rendered for Slurm is submitted (by hand too) and starts (its steps mark ``running`` again at each stage).
MOVES: dict[str, tuple] = {
    PLANNED: (RUNNING,),
    RUNNING: (RUNNING, *HANDED_OFF, *FINAL),
    RENDERED: (SUBMITTED, RUNNING, *FINAL),
    SUBMITTED: (RUNNING, *FINAL),
}


RECORD_RESERVE = 8192  # bytes of spaces after a running record (RunDir.save_record): room for its end on a full disk


def utc_now() -> str:
    """The time now as the record writes it (``2026-12-01T12:00:00Z``)."""
    from datetime import datetime

    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class RunDir:
    """One run directory being written: every file through :meth:`write` (atomic, its sha256 kept in
    :attr:`hashes` by file name), the record through :meth:`save_record`.

    ``path``: the directory (it exists: Hydra made it, or the caller did).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.hashes: dict[str, str] = {}

    def write(self, name: str, data: bytes, mode: int = 0o666, verbatim: bool = False) -> str:
        """Write ``data`` to ``name`` atomically (:func:`trainer.publish.atomic_write`; ``verbatim``: not scrubbed,
        for copies of content verified by digest, under :data:`VERBATIM`); keep and return its sha256."""
        self.hashes[name] = atomic_write(self.path / name, data, mode=mode, verbatim=verbatim)
        return self.hashes[name]

    def write_json(self, name: str, obj: Any) -> str:
        """Write ``obj`` as canonical JSON to ``name`` (:meth:`write`)."""
        return self.write(name, canonical_json(obj))

    def hash_written(self, names=WORKER_FILES) -> dict[str, str]:
        """The sha256 of those of ``names`` that others (the workers: :data:`WORKER_FILES`) wrote, as they now
        stay; kept in :attr:`hashes` too."""
        import hashlib

        found = {
            name: hashlib.sha256((self.path / name).read_bytes()).hexdigest()
            for name in names
            if (self.path / name).is_file()
        }
        self.hashes.update(found)
        return found

    def write_plan(self, prepared: PreparedRun) -> None:
        """The files every run starts with, before anything is launched: ``config.yaml`` (the resolved
        composition), ``command.sh`` (the launch as bash), ``plan.json``, ``argv.json`` (the miles argv) and
        ``env.json`` (its environment, secret values redacted): the files :data:`HYDRA_FILES` aside, the launch
        as ``command.sh`` says it. A ``job.json`` and an ``attestation.json`` an earlier run left here
        (``--resume``) are removed: neither describes this run. The marker :data:`MARKER` is written before any
        of them (not hashed: :meth:`begin` removes it once the record is saved), so that a directory a full disk
        or a kill stopped before its record is known to be this bundle's partial run (:func:`partial_run`)."""
        for stale in (JOB, ATTESTATION):
            (self.path / stale).unlink(missing_ok=True)
        atomic_write(self.path / MARKER, MARKER_TEXT)
        self.write(CONFIG, OmegaConf.to_yaml(prepared.cfg, resolve=True).encode())
        self.write(COMMAND, prepared.launch.shell_script().encode(), mode=0o777)
        self.write_json(PLAN, prepared.plan)
        self.write_json(ARGV, prepared.launch.argv)
        self.write_json(ENV, redact_env(prepared.launch.env))

    def write_job(self, argv: list[str], env: dict[str, str]) -> str:
        """Write ``job.json``: the job a launcher runs or submits, ``{"argv": [...], "env": {...}}`` (the
        environment it gets, secret values redacted). Returns its sha256."""
        return self.write_json(JOB, {"argv": list(argv), "env": redact_env(env)})

    def begin(self, status: str, fields: dict[str, Any]) -> dict[str, Any]:
        """The run's first record, saved: ``planned`` (a plan) or ``running`` (this process's pid, its start time
        ``pid_started``, the ``boot_id`` and ``pid_ns``, :func:`trainer.record.record.process_identity`, so that a
        reader tells a reused pid from the run's process; the start time in ``started_utc``), with ``fields``
        (:meth:`trainer.compose.prepare.PreparedRun.record_fields`) and the hashes of the files written so far.
        Once it is saved, the partial-run marker :data:`MARKER` (:meth:`write_plan`) is removed. The record has
        the shape :class:`trainer.record.record.RunRecord`; it is returned as the plain dict the launchers
        (:mod:`trainer.launch`) edit."""
        assert status in (PLANNED, RUNNING), status
        extra: RunRecordFields = {"files_sha256": self.hashes}
        if status == RUNNING:
            extra.update(process_identity())
        record: dict[str, Any] = {**launcher_record(status, **extra, **fields)}
        if status == RUNNING:
            record["started_utc"] = record["created_utc"]  # job start (a local run has no scheduler admission)
        self.save_record(record)
        (self.path / MARKER).unlink(missing_ok=True)  # the record now says what the directory holds
        return record

    def hash_tree(self) -> dict[str, str]:
        """The sha256 of every regular file of the run directory but ``record.json`` and ``attestation.json``, by
        relative POSIX path. Raises :class:`UserError` for a link or special file in it
        (:func:`trainer.record.attest.run_files`)."""
        import hashlib

        return {
            name: hashlib.sha256((self.path / name).read_bytes()).hexdigest()
            for name in run_files(self.path)
            if name != RECORD
        }

    def seal(self, record: dict[str, Any], signer: Any = None) -> dict[str, Any]:
        """Seal the ended run and return its record, saved: the files others wrote scrubbed
        (:func:`resweep`; :data:`VERBATIM` aside), ``files_sha256`` re-derived for every file,
        the attestation named (path, key id) in the record and the record saved, then ``attestation.json``
        written from the files as they stay (signed by ``signer`` when given:
        :func:`trainer.record.attest.write_run_attestation`). A failure to attest is recorded as
        ``attestation.error``, never fatal, and leaves no attestation."""
        resweep(self.path, VERBATIM)
        (self.path / ATTESTATION).unlink(missing_ok=True)
        try:
            record["files_sha256"] = self.hash_tree()
        except (UserError, OSError) as err:
            record["attestation"] = {"error": " ".join(str(err).split())}
            self.save_record(record)
            return record
        record["attestation"] = {
            "path": ATTESTATION,
            "signed_by": signer.public_key.keyid if signer is not None else None,
        }
        self.save_record(record)
        try:
            write_run_attestation(self.path, record, signer)
        except (UserError, OSError, ValueError) as err:
            (self.path / ATTESTATION).unlink(missing_ok=True)
            record["attestation"] = {"error": " ".join(str(err).split())}
            self.save_record(record)
        return record

    def reseal(self, signer: Any = None) -> dict[str, Any] | None:
        """Seal an ended run again after a late change to its files (train's last sweep rewrote one): every hash
        re-derived, the attestation written anew. Returns the record, or None when the run was not sealed (no
        final record with an attestation), in which case nothing is done."""
        record = self.load_record()
        if not record or record.get("status") not in FINAL or "attestation" not in record:
            return None
        return self.seal(record, signer)

    def finish(self, record: dict[str, Any], signer: Any = None) -> dict[str, Any]:
        """The record of a launch that handed back, completed and saved: what others wrote into the directory
        redacted (:func:`resweep`) and hashed (:data:`WORKER_FILES`), :meth:`hand_back`, and
        :meth:`seal` unless the run was handed off to a scheduler (its job ends it)."""
        handed_off = record["status"] in HANDED_OFF  # as the launcher says: a submitted job may have moved on since
        resweep(self.path, VERBATIM)
        self.hash_written()
        record = self.hand_back(record)
        if handed_off:
            self.save_record(record)
            return record
        return self.seal(record, signer)

    def load_record(self) -> dict[str, Any] | None:
        """``record.json`` as it is on disk, to edit and save again (:func:`read_record`), or None."""
        return read_record(self.path)

    def save_record(self, record: dict[str, Any]) -> None:
        """Write ``record.json`` (canonical JSON, atomically): the one way the record is written. A ``running``
        record is followed by :data:`RECORD_RESERVE` bytes of spaces (JSON allows them): room kept for writing how
        the run ended over it in place when the disk fills during the run (:meth:`record_out_of_room`)."""
        data = canonical_json(record)
        atomic_write(
            self.path / RECORD, data + b" " * RECORD_RESERVE + b"\n" if record.get("status") == RUNNING else data
        )

    def move(self, record: dict[str, Any], status: str, **fields: Any) -> dict[str, Any]:
        """``record`` moved to the state ``status`` (and ``fields`` set), unsaved; the one place a state is set.
        Raises :class:`UserError` naming ``record.json`` when :data:`MOVES` has no such move from its state (an
        ended run does not start again)."""
        before = record.get("status")
        allowed = MOVES.get(before, ()) if isinstance(before, str) else ()
        if status not in allowed:
            raise UserError(
                f"{self.path / RECORD}: a run {before} cannot become {status} "
                f"(expected one of {', '.join(allowed) or 'none: it has ended'})"
            )
        record.update(status=status, **fields)
        return record

    def hand_off(self, record: dict[str, Any], status: str, message: str) -> dict[str, Any]:
        """``record`` handed off to a scheduler (``status`` ``rendered`` or ``submitted``), with the ``message``
        ``train`` prints; unsaved (:meth:`hand_back` then drops the pid)."""
        assert status in HANDED_OFF, status
        return self.move(record, status, message=message)

    def end(self, record: dict[str, Any], status: str, reason: str | None = None) -> dict[str, Any]:
        """``record`` moved to the final state ``status`` (with ``reason``, its secrets redacted: by the directory's
        redactor, :func:`trainer.redact.guarding`, or else by the rule's patterns), unsaved."""
        assert status in FINAL, status
        if reason is not None:
            redactor = redactor_for(self.path)
            reason = redactor.scrub(reason) if redactor is not None else redact_value(reason)
        return self.move(record, status, reason=reason)

    def hand_back(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record once the launcher handed back: handed off (``rendered``/``submitted``: no pid, the time in
        ``handed_off_utc``; a submitted job that already wrote its own state keeps what it wrote) or ended
        (``finished_utc``); the hashes of the launch's files added. Unsaved."""
        now = utc_now()
        handed_off = record["status"] in HANDED_OFF
        if record["status"] == SUBMITTED:
            # the job may already have started and written its own status (it drops our pid): keep what it wrote
            on_disk = self.load_record() or {}
            if on_disk and "pid" not in on_disk:
                on_disk.setdefault("slurm", {}).update(
                    {k: v for k, v in (record.get("slurm") or {}).items() if v is not None}
                )
                record = on_disk
        if handed_off:
            for key in ("pid", "pid_started", "boot_id", "pid_ns"):  # the run no longer lives in this process
                record.pop(key, None)
            record["handed_off_utc"] = now
        else:
            record["finished_utc"] = now
        record.setdefault("files_sha256", {}).update(self.hashes)
        return record

    def record_out_of_room(self, record: dict[str, Any], err: OSError) -> bool:
        """Record how a run ended when a write of its end stopped on the place (``err``: ``ENOSPC``, ``EDQUOT`` or
        ``EROFS``, :data:`trainer.errors.STORAGE_ERRNOS`; the disk filled while the run executed): ``record`` (edited
        in place) ends ``failed`` with the reason (the file and the error, :func:`trainer.errors.os_error_line`,
        after the launcher's own reason when it had ended the run), or keeps the final state it had, and is marked
        not attested (``attestation.error``: its hashes were not all re-derived). It is saved atomically where
        there is room; where there is none, it is written over the record on disk, as compact JSON padded with
        spaces to the old length, only when it fits in the bytes the old one holds (so that, on file systems that
        write in place, no block is allocated and nothing can be cut short by the full disk; a copy-on-write one,
        btrfs, ZFS, may need new blocks for it too and refuse it: then this returns False). Returns whether the
        record on disk now says so; when it does not, the record still says ``running`` and
        :func:`trainer.record.record.process_gone` makes readers see the run ``interrupted`` once this process has
        ended."""
        line = os_error_line(err)
        if record.get("status") in FINAL:
            if record.get("reason") and line not in record["reason"]:
                record["reason"] = f"{record['reason']}; then {line}"
        elif record.get("status") == RUNNING:  # a run handed off to a scheduler is its job's to end
            self.end(record, FAILED, f"{line} (the disk filled while the run executed)")
        record["attestation"] = {"error": f"not attested: {line}"}
        record.setdefault("finished_utc", utc_now())
        (self.path / ATTESTATION).unlink(missing_ok=True)  # it would not describe the files as they stay
        try:
            self.save_record(record)
            return True
        except OSError:
            pass
        try:  # the whole record, else the one on disk with only how the run ended changed (no new hashes)
            on_disk = read_record(self.path) or {}
        except UserError:
            on_disk = {}
        ended: dict[str, Any] = {
            **on_disk,
            **{k: record[k] for k in ("status", "reason", "attestation", "finished_utc") if k in record},
        }
        redactor = redactor_for(self.path / RECORD)  # as atomic_write scrubs every file of a guarded run directory
        try:
            fd = os.open(self.path / RECORD, os.O_WRONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            for candidate in (record, ended) if on_disk else (record,):
                data = json.dumps(candidate, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
                data = redactor.scrub_bytes(data) if redactor is not None else data
                if len(data) < size:
                    os.pwrite(fd, data + b" " * (size - len(data) - 1) + b"\n", 0)
                    os.fsync(fd)
                    return True
            return False
        except OSError:
            return False
        finally:
            os.close(fd)

    def update(self, change) -> dict[str, Any]:
        """Read the record, apply ``change(record)`` (which edits it in place) and save it; return it. Raises
        :class:`UserError` when the directory has no readable record."""
        path = self.path / RECORD
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as ex:
            raise UserError(f"{path}: no readable run record ({ex})") from None
        change(record)
        self.save_record(record)
        return record


def load_config(path: Path) -> DictConfig:
    """``config.yaml`` of a run merged into the schema (:class:`trainer.compose.schema.TrainConfig`).

    Raises :class:`UserError` naming the file on unreadable YAML, unknown keys, wrong types, missing values, or
    values no run can have (:func:`trainer.compose.checks.check_values`: NaN, negative, a zero peak, a bad env name).
    """
    with reading(path, unreadable=f"{path}: not readable"):
        raw = read_yaml(path, "run's config.yaml")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping (the resolved composition train writes)")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema.TrainConfig), raw)
        OmegaConf.to_object(cfg)
    except OmegaConfBaseException as ex:
        key = getattr(ex, "full_key", None)
        msg = (getattr(ex, "msg", None) or str(ex)).splitlines()[0]
        raise UserError(f"{path}: {msg}" + (f" (key: {key})" if key else "")) from None
    assert isinstance(cfg, DictConfig)
    try:
        check_values(train_config_of(cfg))  # a run's figures need finite, non-negative sizes, prices and peaks
    except UserError as ex:
        raise UserError(f"{path}: {ex}") from None
    return cfg


def train_config_of(cfg: DictConfig) -> schema.TrainConfig:
    """``cfg``, merged into :class:`trainer.compose.schema.TrainConfig`, as that dataclass
    (``OmegaConf.to_object``); raises what OmegaConf raises for a missing or wrongly typed value."""
    config = OmegaConf.to_object(cfg)
    if not isinstance(config, schema.TrainConfig):  # a structured config gives its dataclass
        raise TypeError(f"expected a TrainConfig composition, got {type(config).__name__}")
    return config


def load_record(directory: Path) -> RunRecord | None:
    """``record.json`` of a run directory to read, or None if it has none; raises :class:`UserError` if unreadable
    or a field has the wrong JSON type (:func:`read_record`)."""
    # the fields' JSON types are checked (check_record_types), their presence is not: RunRecord says so
    return cast("RunRecord | None", read_record(directory))


def read_record(directory: Path) -> dict[str, Any] | None:
    """``record.json`` of a run directory, as a dict to edit and save again (:meth:`RunDir.save_record`), or None
    if it has none; raises :class:`UserError` if unreadable or a field has the wrong JSON type
    (:func:`check_record_types`)."""
    path = directory / RECORD
    if not path.exists():
        return None
    with reading(path, unreadable=f"{path}: not readable"):
        record = read_json(path, "run record")
    if not isinstance(record, dict):
        raise UserError(f"{path}: expected a JSON object")
    check_record_types(record, str(path))
    return record


# The type of every field of record.json that readers use (None is allowed for each): a record with a field of
# another type is refused on one line instead of failing somewhere inside a report.
RECORD_TYPES: dict[str, Any] = {
    "schema_version": int,
    "status": str,
    "kind": str,
    "launcher": str,
    "host": str,
    "reason": str,
    "message": str,
    "pid": int,
    "pid_started": int,
    "boot_id": str,
    "pid_ns": str,
    "created_utc": str,
    "started_utc": str,
    "finished_utc": str,
    "handed_off_utc": str,
    "bundle": dict,
    "launcher_env": dict,
    "locks": dict,
    "lock": dict,
    "stack": dict,
    "choices": dict,
    "files_sha256": dict,
    "ended_by": str,
    "attempts": list,
    "resumed_from": dict,
    "overrides": list,
    "command": list,
    "probe": dict,
    "slurm": dict,
    "ray": dict,
    "image": dict,
    "data": dict,
    "times": dict,
    "preflight": dict,
    "logs": (dict, list, str),
    "observed_versions": dict,
    "observed": dict,
}
NESTED_TYPES: dict[str, dict[str, Any]] = {
    "probe": {"ranks": list, "nodes": list},
    "lock": {"path": str},
    "slurm": {
        "job_id": (str, int),
        "state": str,
        "submitted_utc": str,
        "started_utc": str,
        "finished_utc": str,
        "nodes": list,
    },
    "times": {"admitted_utc": str, "started_utc": str, "finished_utc": str},
}


def check_record_types(record: Mapping[str, Any], where: str) -> None:
    """Refuse a record whose known fields (:data:`RECORD_TYPES`, :data:`NESTED_TYPES`) have the wrong JSON type.
    Raises :class:`UserError` naming the field, the type found and the type expected."""

    def check(value: Any, kind: Any, key: str) -> None:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if value is None or (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
            return
        expected = " or ".join({dict: "object", list: "array", str: "string", int: "integer"}[k] for k in kinds)
        raise UserError(f"{where}: {key} is {type(value).__name__} {json.dumps(value)[:40]}, expected {expected}")

    for key, kind in RECORD_TYPES.items():
        check(record.get(key), kind, key)
    for key, fields in NESTED_TYPES.items():
        for sub, kind in fields.items():
            check((record.get(key) or {}).get(sub), kind, f"{key}.{sub}")
    for i, rank in enumerate(((record.get("probe") or {}).get("ranks")) or []):
        check(rank, dict, f"probe.ranks[{i}]")
        if rank is None:
            raise UserError(f"{where}: probe.ranks[{i}] is null, expected object (a rank's probe)")
        for sub in ("torch", "packages", "env", "image", "nccl", "cuda"):
            check(rank.get(sub), dict, f"probe.ranks[{i}].{sub}")


# What `train` itself writes into a run directory before the task runs (Hydra's log and record of the composition).
HYDRA_FILES = (".hydra", "train.log")
CLAIM_MODES = ("new", "resume", "overwrite")
# What a run writes into its directory besides the files its record hashes (files_sha256): the names --overwrite
# removes (:func:`run_entries`). Folders, removed whole: the job logs, the per-node probes, the rows built for the
# run (local-cpu), a local-image run's stamped lock, the JIT kernel caches' fallback, Hydra's record, the CPU
# worker's checkpoints, the earlier attempts' records (--resume).
DATA, KERNELS, RENDEZVOUS = "data", "kernels", ".rendezvous"  # rows built for a run, kernel caches, gloo's file
RUN_FOLDERS = (LOGS, PROBES, DATA, "image", KERNELS, HYDRA_FILES[0], CHECKPOINTS, ATTEMPTS)
# The marker a run writes first (RunDir.write_plan) and removes once its first record is saved (RunDir.begin): the
# evidence that a directory without record.json holds a partial run of this bundle, not a user's files.
MARKER = ".recipe-bundle-run"
MARKER_TEXT = b"recipe-bundle: a run is being written here; its record.json follows (trainer.record.rundir)\n"
# Files: the plan's, the launchers', the workers', the record and its attestation, Hydra's log, the marker (left when
# a run is killed between its record and the marker's removal) (and probe-rank-N.json, :func:`probe_rank`, one per
# local rank).
RUN_FILES = (
    RECORD,
    ATTESTATION,
    METRICS,
    HYDRA_FILES[1],
    CONFIG,
    COMMAND,
    PLAN,
    ARGV,
    ENV,
    JOB,
    SBATCH,
    SUBMIT,
    RUNTIME_ENV,
    MEGATRON,
    PROFILE,
    SANDBOX,
    PREFLIGHT,
    RENDEZVOUS,
    MARKER,
)
RECORD_STATES = (PLANNED, RUNNING, *HANDED_OFF, *FINAL)  # every state a run's record.json can be in
# What a run writes before its record (RunDir.write_plan, then RunDir.begin): a directory holding the marker
# (:data:`MARKER`), only these, Hydra's files (.hydra/ with only Hydra's three, :data:`HYDRA_RECORD`, train.log), the
# temporary siblings of an atomic write of one of them, of the marker or of the record (``.NAME.XXXXXXXX``), and no
# record.json holds a partial run, one that stopped (a full disk, a kill) before its first record: refused by name,
# removed by --overwrite (:func:`partial_run`).
PLAN_FILES = (CONFIG, COMMAND, PLAN, ARGV, ENV)
HYDRA_RECORD = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra writes into .hydra/, all it writes


def _atomic_debris(name: str, names=(*PLAN_FILES, RECORD, MARKER)) -> bool:
    """Whether ``name`` is the temporary sibling of an atomic write of one of ``names`` (``.NAME.`` and mkstemp's
    8 random characters, :func:`trainer.publish.atomic_file`): what a write killed or cut short leaves."""
    return any(name.startswith(f".{n}.") and len(name) == len(n) + 10 for n in names)


def _hydra_only(entry: Path) -> bool:
    """Whether ``entry`` is Hydra's ``.hydra/``: a real folder (not a link) holding only regular files named
    :data:`HYDRA_RECORD` (no link, no folder, no other name). Raises ``OSError`` when it cannot be read."""
    if entry.is_symlink() or not entry.is_dir():
        return False
    return all(child.name in HYDRA_RECORD and not child.is_symlink() and child.is_file() for child in entry.iterdir())


def partial_run(path: Path) -> list[Path] | None:
    """The entries of a partial run in the directory ``path`` (see :data:`PLAN_FILES`), or None when it is not
    one: no marker :data:`MARKER` (a regular file) is there (a user's lone ``config.yaml``, ``command.sh`` or
    ``train.log``: no run of this bundle wrote them), a ``record.json`` is, or any other entry is (a folder, a
    link, a file of another name, a ``.hydra`` that is a link or holds anything but Hydra's three files). The
    evidence is the marker, not the names: a user's ``.plan.json.backup01`` looks like the temporary file of an
    atomic write, and is one only beside the marker. Raises ``OSError`` when it cannot be read."""
    entries = sorted(Path(path).iterdir())
    names = {e.name: e for e in entries}
    marker = names.get(MARKER)
    if RECORD in names or marker is None or marker.is_symlink() or not marker.is_file():
        return None
    for entry in entries:
        if entry.name == HYDRA_FILES[0]:
            if not _hydra_only(entry):
                return None
        elif (
            entry.is_symlink()
            or not entry.is_file()
            or not (entry.name in (*PLAN_FILES, MARKER, HYDRA_FILES[1]) or _atomic_debris(entry.name))
        ):
            return None
    return entries  # Hydra's .hydra/ (its three files) and train.log go too


def others_in(path: Path) -> list[str]:
    """The names in the directory ``path`` that Hydra did not write (:data:`HYDRA_FILES` aside), sorted: a run
    directory Hydra chose that holds any was taken by another run. Raises ``OSError`` when it cannot be read."""
    return sorted(p.name for p in Path(path).iterdir() if p.name not in HYDRA_FILES)


def run_record(path: Path, where: str) -> RunRecord:
    """The record of the run the directory ``path`` holds: a ``record.json`` that is a JSON object of the record's
    types (:func:`check_record_types`) with a known ``status`` (:data:`RECORD_STATES`) and a ``files_sha256``
    object. Raises :class:`UserError` (one line starting with ``where``) for a missing, unreadable or other
    ``record.json`` (one no run wrote)."""
    try:
        record = load_record(Path(path))
    except UserError as ex:
        raise UserError(f"{where}: its {RECORD} is not a run's record ({ex}); choose a new directory") from None
    if record is None:
        raise UserError(f"{where}: holds no {RECORD}; choose a new directory")
    if record.get("status") not in RECORD_STATES or not isinstance(record.get("files_sha256"), dict):
        what = (
            f"status {json.dumps(record.get('status'))[:40]}"
            if record.get("status") not in RECORD_STATES
            else "no files_sha256 object"
        )
        raise UserError(f"{where}: its {RECORD} is not a run's record ({what}); choose a new directory")
    return record


def _probe_rank_file(name: str) -> bool:
    """Whether ``name`` is a local worker's probe file, ``probe-rank-N.json`` (:func:`probe_rank`)."""
    rank = name[len("probe-rank-") : -len(".json")] if name.startswith("probe-rank-") and name.endswith(".json") else ""
    return rank.isdigit() and rank.isascii()


def _listed(record: Mapping[str, Any]) -> set:
    """The files ``record`` hashes (``files_sha256``'s keys) that name a place inside the directory: relative POSIX
    paths without ``..`` (normalised: ``./a`` is ``a``)."""
    from pathlib import PurePosixPath

    names = set()
    for key in record.get("files_sha256") or {}:
        if isinstance(key, str) and key and not key.startswith("/") and "\0" not in key:
            path = PurePosixPath(key)
            if ".." not in path.parts and path.as_posix() not in ("", "."):
                names.add(path.as_posix())
    return names


def run_entries(path: Path, record: Mapping[str, Any]) -> tuple[list[Path], list[Path], list[str]]:
    """What of the directory ``path`` its run ``record`` (:func:`run_record`) accounts for, never following a link:
    (the entries a run wrote: :data:`RUN_FILES`, ``probe-rank-N.json``, :data:`RUN_FOLDERS` whole, and every file
    ``files_sha256`` lists; the folders that hold only listed files, deepest first; everything else, as relative
    paths, a folder with a trailing ``/``). Raises ``OSError`` when a folder cannot be read."""
    listed = _listed(record)
    removable: list[Path] = []
    folders: list[Path] = []
    foreign: list[str] = []

    def walk(directory: Path, rel: str) -> bool:  # True when every entry of the folder is the run's
        clean = True
        for entry in sorted(directory.iterdir()):
            name = f"{rel}{entry.name}"
            real_dir = entry.is_dir() and not entry.is_symlink()
            if not rel and entry.name == HYDRA_FILES[0] and real_dir and not _hydra_only(entry):
                clean = False  # a .hydra/ holding more than Hydra's three files: the user's files are in it
                foreign.append(f"{name}/")
            elif not rel and (
                (entry.name in RUN_FILES or _probe_rank_file(entry.name))
                and not real_dir
                or entry.name in RUN_FOLDERS
                and (real_dir or entry.is_symlink())
            ):
                removable.append(entry)
            elif name in listed and not real_dir:
                removable.append(entry)
            elif real_dir and any(key.startswith(f"{name}/") for key in listed) and walk(entry, f"{name}/"):
                folders.append(entry)
            else:
                clean = False
                if not (real_dir and any(key.startswith(f"{name}/") for key in listed)):
                    foreign.append(name + ("/" if real_dir else ""))
        return clean

    walk(Path(path), "")
    return removable, folders, foreign


def _removal(path: Path, record: Mapping[str, Any], where: str) -> tuple[list[Path], list[Path]]:
    """What --overwrite removes of the run ``record`` describes in ``path``: (the entries, the emptied folders) of
    :func:`run_entries`. Raises :class:`UserError` (one line starting with ``where``, naming up to 3 of them) when
    the directory holds anything else, so that nothing at all is removed."""
    try:
        removable, folders, foreign = run_entries(path, record)
    except OSError as ex:
        raise UserError(f"{where}: not readable ({ex.strerror})") from None
    if foreign:
        raise UserError(
            f"{where}: holds files its run's {RECORD} does not list ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); --overwrite removes only a run's files: move "
            "them away or choose a new directory"
        )
    return removable, folders


def _remove(plan: tuple[list[Path], list[Path]], where: str) -> None:
    """Remove what :func:`_removal` planned, never following a link. Raises :class:`UserError` when an entry
    cannot be removed."""
    import shutil

    removable, folders = plan
    try:
        for entry in removable:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for folder in folders:  # deepest first: each holds nothing now
            folder.rmdir()
    except OSError as ex:
        raise UserError(f"{where}: cannot remove the old run's {ex.filename} ({ex.strerror})") from None


def claim_run_dir(value: str, mode: str = "new", field: str = "hydra.run.dir", composition: str | None = None) -> Path:
    """The one owner of a run directory's place: refuse ``value`` unless a run may be written there.

    ``value`` is the literal directory (interpolations resolved before:
    :func:`trainer.compose.commandline.resolve_run_dir`). ``mode`` ``new`` (default) needs a missing or empty
    directory (Hydra's own ``.hydra/`` and ``train.log`` aside); ``resume`` also accepts a directory holding a run
    (a ``record.json`` of a run: :func:`run_record`) of the same composition (its ``composition_sha256`` equal to
    ``composition``, the command line's) and writes into it; ``overwrite`` accepts a directory holding a run and
    nothing else (:func:`run_entries`) and removes that run's files first, only those. A directory holding
    files that no run wrote is refused in every mode, as are an empty value, an unresolved interpolation, the
    filesystem root, the current directory, one above it, the home directory, a file, and a place that cannot be
    written. Returns the path. Raises :class:`UserError` (one line naming ``field``); nothing is created, and
    nothing is removed unless every check passed.

    A directory holding a partial run (:func:`partial_run`: the marker :data:`MARKER` a run writes first, only the
    files a run writes before its record, Hydra's three in ``.hydra/``, no ``record.json``) is refused naming it
    ("holds a partial run (no record.json); pass --overwrite"), and ``overwrite`` removes it. An ``OSError`` of
    the place (a component longer than the file system takes, no permission) is one line naming ``field`` and the
    path (:func:`trainer.errors.os_error_line`).
    """
    try:
        return _claim_run_dir(value, mode, field, composition)
    except OSError as ex:
        raise UserError(f"{field}={value}: {os_error_line(ex)}") from None


def _claim_run_dir(value: str, mode: str, field: str, composition: str | None) -> Path:
    """:func:`claim_run_dir`; the caller turns its ``OSError`` into one line."""
    import shutil
    import tempfile

    if mode not in CLAIM_MODES:
        raise UserError(f"{field}: unknown mode {mode!r} (expected one of {', '.join(CLAIM_MODES)})")
    if not value.strip():
        raise UserError(f"{field}: empty (a run needs its own directory, e.g. {field}=outputs/my-run)")
    if "${" in value:
        raise UserError(
            f"{field}={value}: an interpolation, unresolved (a run directory is claimed as Hydra will "
            "use it, every interpolation resolved)"
        )
    where = f"{field}={value}"
    path = Path(value).expanduser()
    resolved = path.resolve()
    if resolved == Path(resolved.anchor):
        raise UserError(f"{where}: the filesystem root cannot be a run directory")
    if resolved in (Path.cwd().resolve(), *Path.cwd().resolve().parents, Path.home().resolve()):
        raise UserError(f"{where}: the current directory, one above it or the home directory cannot be a run directory")
    if path.exists() and not path.is_dir():
        raise UserError(f"{where}: exists and is not a directory")
    record: RunRecord | None = None
    removal: tuple[list[Path], list[Path]] | None = None
    if path.is_dir():
        try:
            entries, others = sorted(p.name for p in path.iterdir()), others_in(path)
        except OSError as ex:
            raise UserError(f"{where}: not readable ({ex.strerror})") from None
        partial = partial_run(path) if others and RECORD not in entries else None
        if others and RECORD not in entries and partial is None:
            raise UserError(
                f"{where}: holds files that no run wrote ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}); choose a new or empty directory"
            )
        if partial is not None and mode != "overwrite":
            raise UserError(
                f"{where}: holds a partial run (no {RECORD}: a run that stopped before its record was "
                f"written, e.g. on a full disk); pass --overwrite to remove it, or choose a new directory"
            )
        if partial is not None:
            removal = (partial, [])
        elif others and mode == "new":
            status = "unreadable"
            try:
                status = effective_status(load_record(path) or {})
            except UserError:
                pass
            raise UserError(
                f"{where}: holds another run (status {status}); pass --resume to write into it "
                "or --overwrite to replace it, or choose a new directory"
            )
        elif others:
            record = run_record(path, where)
        if (
            record is not None
            and mode == "resume"
            and (composition is None or record.get("composition_sha256") != composition)
        ):
            theirs = record.get("composition_sha256")
            raise UserError(
                f"{where}: holds a run of another composition (composition sha256 "
                f"{theirs if isinstance(theirs, str) else 'none recorded'}, this command line's "
                f"{composition or 'none: several jobs'}); choose a new directory or --overwrite"
            )
        if record is not None and mode == "overwrite":
            removal = _removal(path, record, where)  # refuses before anything is removed
    # the nearest existing directory must take a new entry (read-only file systems and permissions alike)
    parent = path if path.is_dir() else next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if not parent.is_dir():
        raise UserError(f"{where}: {parent} is not a directory")
    try:
        shutil.rmtree(tempfile.mkdtemp(prefix=".train-probe-", dir=parent))
    except OSError as ex:
        raise UserError(f"{where}: cannot write in {parent} ({ex.strerror})") from None
    if removal is not None:
        _remove(removal, where)
    return path


# ------------------------------------------------------------------------------------------------ redaction
# A run directory's files passed through its run's redactor (trainer.redact) after others wrote them.

# Files larger than this are read in chunks of this size: a chunk is scrubbed with the OVERLAP characters after
# it in view and cut at a line end no secret crosses (see scrub_file).
CHUNK_BYTES = 16 << 20


def sweep(directory: Path, redactor: Redactor, verbatim: Iterable[str] = ()) -> list[str]:
    """Pass every regular file under ``directory`` through ``redactor`` and rewrite those that changed (atomically,
    keeping their mode: :func:`scrub_file`); returns their paths relative to ``directory``, sorted.

    Done: every regular file, whatever its size (a file over :data:`CHUNK_BYTES`, 256 MiB and more, is streamed in
    chunks) and content (NUL bytes, bytes that are not UTF-8: they round-trip unchanged, as does everything but
    the redacted spans). Not done: a symbolic link and what it points to (neither is followed; ``train --resume``
    refuses a run directory holding one, and an attestation refuses links), FIFOs and other special files, the
    folders ``verbatim`` names (paths relative to ``directory``: copies of content verified by digest, which a
    rewrite would make untrue), files written after the sweep (a Slurm job's own logs)."""
    directory = Path(directory)
    skipped = [directory / name for name in verbatim]
    changed = []
    for path in sorted(directory.rglob("*")):
        if any(path == top or top in path.parents for top in skipped):
            continue
        if scrub_file(path, redactor):
            changed.append(path.relative_to(directory).as_posix())
    return changed


def _pieces(handle: Any, redactor: Redactor) -> Iterator[tuple[str, list[tuple[int, int]]]]:
    """The text of ``handle`` (bytes, surrogateescape) in pieces of about :data:`CHUNK_BYTES`, each with the spans to
    redact in it. A piece ends at a line end with :data:`OVERLAP` characters or more of the file read past it, and
    no span found in what was read crosses its end; a line longer than a chunk is cut inside, after the end of
    the span that crosses the cut (a secret whose serialisation is longer than :data:`OVERLAP` and crosses the
    cut of such a line is replaced in part)."""
    carry = b""
    while True:
        data = handle.read(CHUNK_BYTES)
        buffer = carry + data
        text = buffer.decode("utf-8", "surrogateescape")
        spans = redactor._spans(text)
        if not data:
            yield text, spans
            return
        limit = max(len(text) - OVERLAP, 1)
        cut = text.rfind("\n", 0, limit) + 1
        for start, end in spans:
            if start < cut < end:
                cut = text.rfind("\n", 0, start) + 1
        if cut <= 0:  # one line longer than a chunk: cut inside it, never inside a span
            cut = limit
            for start, end in spans:
                if start < cut < end:
                    cut = end
        head = [(s, e) for s, e in spans if e <= cut]
        yield text[:cut], head
        carry = text[cut:].encode("utf-8", "surrogateescape")


def scrub_file(path: Path, redactor: Redactor) -> bool:
    """Pass the regular file ``path`` (not a link; any size, NUL bytes and bytes that are not UTF-8 included)
    through ``redactor``, rewriting it atomically with its mode when that changed it; returns whether it did. A
    file of at most :data:`CHUNK_BYTES` is scrubbed whole; a larger one is read once, in pieces (:func:`_pieces`),
    into a temporary copy that replaces it only when a piece changed. A missing file is left alone."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    mode = path.stat().st_mode & 0o777
    if path.stat().st_size <= CHUNK_BYTES:
        data = path.read_bytes()
        clean = redactor.scrub_bytes(data)
        if clean != data:
            try:
                atomic_write(path, clean, mode=mode, umask=False)
            except OSError as err:
                if not _scrub_in_place(path, clean, err):
                    raise
        return clean != data
    try:
        with path.open("rb") as handle, atomic_file(path, mode, umask_applies=False) as out:
            changed = False
            for text, spans in _pieces(handle, redactor):
                changed = changed or bool(spans)
                out.write(_apply(text, spans).encode("utf-8", "surrogateescape"))
            if not changed:
                raise _Unchanged()
    except _Unchanged:
        return False
    return True


def _scrub_in_place(path: Path, clean: bytes, err: OSError) -> bool:
    """After ``err``, a full disk or quota (no room for the temporary copy an atomic rewrite needs): rewrite
    ``path`` in place, which needs no new blocks when ``clean`` is not longer than what the file holds (on file
    systems that write in place; copy-on-write ones may refuse this too), else empty it, saying so on stderr (a
    secret left is worse than a log lost). Returns False when ``err`` is another error or this fails too."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if len(clean) <= os.fstat(fd).st_size:
            os.pwrite(fd, clean, 0)
            os.ftruncate(fd, len(clean))
            return True
        os.ftruncate(fd, 0)
        _last_words(f"train: warning: {path}: no room to write it redacted; emptied rather than kept with a secret")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class _Unchanged(Exception):
    """Nothing to redact in a large file: its temporary copy is dropped (:func:`trainer.publish.atomic_file`)."""


def resweep(directory: Path, verbatim: Iterable[str] = ()) -> list[str]:
    """Pass the files others wrote into the guarded ``directory`` (Hydra's, the workers') through its redactor now
    (:func:`sweep`, ``verbatim`` folders aside), so that hashes taken next are those of the files as they stay;
    nothing happens outside a guarded directory. Returns the paths it rewrote."""
    redactor = redactor_for(directory)
    return sweep(directory, redactor, verbatim) if redactor is not None else []
