"""Checkpoints of the CPU worker's training, in Megatron's layout, and the choice of the one to resume from.

Layout (Megatron-LM ``megatron/training/checkpointing.py``, ``get_checkpoint_name`` and the tracker file): under
``RUN_DIR/checkpoints/`` (Megatron's ``--save``), one folder per saved iteration ``iter_0000004/`` holding
``mp_rank_00/model_optim_rng.pt`` (one model-parallel rank: the CPU worker's ranks are data-parallel replicas,
so rank 0 saves for all), and ``latest_checkpointed_iteration.txt`` naming the newest iteration, written after
it. A save writes the folder under a temporary name and renames it; the tracker is replaced atomically: a kill
at any point leaves the previous checkpoint current. Beside the file, ``model_optim_rng.pt.sha256`` holds its
sha256 as the saving worker wrote it (``sha256sum``'s line, :func:`trainer.record.names.checkpoint_state_sha256`):
what vouches for it when the run ended before its record could hash it (a killed launcher, a lost first node).

The file is ``torch.save`` of ``{"iteration", "model", "optimizer", "rng_state", "checkpoint_version"}``:
the model's and AdamW's ``state_dict()``, torch's CPU generator state. The host never loads it (that would
unpickle what the run wrote); it chooses one by the tracker and checks the tracker's and the checkpoint's bytes
against the sha256 the previous attempt's record holds (:func:`trainer.record.attempts.vouched_checkpoint`)
(or, where that record ended unsealed and holds no checkpoint's hash, the sha256 file its worker wrote beside
it: :func:`trainer.record.attempts.vouched_by`) before a
``--resume`` starts, and names it in the new record's ``resumed_from``. The worker loads that one only
(:func:`load`: never the tracker's), its bytes read once and checked against that sha256 before ``torch.load``.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import UserError
from trainer.inputs import open_regular
from trainer.publish import atomic_write
from trainer.record.attempts import ITERATION, TRACKER
from trainer.record.names import CHECKPOINTS, RECORD, checkpoint_state
from trainer.record.record import sha256_file

if TYPE_CHECKING:
    import torch

STATE = "mp_rank_00/model_optim_rng.pt"  # Megatron's file of model-parallel rank 0 (no TP/PP: the only one)
CHECKPOINT_VERSION = 3.0  # Megatron's checkpoint_version of this layout


def iteration_dir(run_dir: Path, iteration: int) -> Path:
    """``RUN_DIR/checkpoints/iter_NNNNNNN`` (Megatron's 7-digit, zero-padded iteration)."""
    return Path(run_dir) / CHECKPOINTS / f"iter_{iteration:07d}"


def state_path(iteration: int) -> str:
    """The checkpoint file of ``iteration`` relative to the run directory (POSIX), as a record's
    ``files_sha256`` names it (:func:`trainer.record.names.checkpoint_state`)."""
    return checkpoint_state(iteration)


def save(run_dir: Path, iteration: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Save the state after ``iteration`` optimizer steps (1-based: steps 1..iteration done) and make it the
    latest; ``model`` unwrapped from DDP when wrapped. Returns the checkpoint file. The folder, the file's sha256
    file beside it included, is written under a temporary name and renamed; then the tracker (atomically).
    Raises ``OSError`` from the file system."""
    import torch

    module = getattr(model, "module", model)
    target = iteration_dir(run_dir, iteration)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        (staging / STATE).parent.mkdir(parents=True)
        state: dict[str, Any] = {
            "iteration": iteration,
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng_state": torch.get_rng_state(),
            "checkpoint_version": CHECKPOINT_VERSION,
        }
        with open(staging / STATE, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        sums = staging / f"{STATE}.sha256"
        with open(sums, "w") as handle:
            handle.write(f"{sha256_file(staging / STATE)}  {Path(STATE).name}\n")
            handle.flush()
            os.fsync(handle.fileno())
        for path in (staging, staging / STATE.split("/")[0]):
            path.chmod(0o755)
        if target.exists():  # a save of the same iteration by an attempt that did not reach the tracker
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    atomic_write(target.parent / TRACKER, f"{iteration}\n".encode())
    return target / STATE


def load(
    run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, resumed_from: Mapping[str, Any] | None
) -> int:
    """Load the checkpoint that the run's record names in ``resumed_from`` (``{"attempt", "iteration",
    "checkpoint", "sha256"}``, :func:`trainer.record.attempts.continue_attempt`) into ``model`` (unwrapped from DDP
    when wrapped) and ``optimizer`` and restore torch's CPU generator; returns its iteration. None, or iteration 0:
    nothing is loaded, 0 returned (a run from step 1; the tracker is never read). The file's bytes are read once
    and their sha256 compared with ``resumed_from``'s before ``torch.load`` reads those same bytes. Raises
    :class:`UserError` naming ``record.json`` when ``resumed_from`` is not of that shape (an iteration of 1 to 9
    digits, its checkpoint's path, a sha256), and naming the file when it is missing, unreadable, of other
    bytes, not a checkpoint or of another iteration."""
    import torch

    if resumed_from is None:
        return 0
    iteration, rel, sha256 = (resumed_from.get(key) for key in ("iteration", "checkpoint", "sha256"))
    if type(iteration) is int and iteration == 0 and rel is None and sha256 is None:
        return 0  # a resume from the start: the earlier attempt left no checkpoint
    if (
        isinstance(iteration, bool)
        or not isinstance(iteration, int)
        or not ITERATION.fullmatch(str(iteration))
        or iteration < 1
        or rel != state_path(iteration)
        or not isinstance(sha256, str)
        or not re.fullmatch(r"[0-9a-f]{64}", sha256)
    ):
        raise UserError(
            f"{Path(run_dir) / RECORD}: resumed_from {str(dict(resumed_from))[:200]} names no checkpoint "
            "(expected an iteration of 1 to 9 digits, its checkpoint file and its sha256)"
        )
    path = Path(run_dir) / rel
    try:
        with open_regular(path, "checkpoint", None) as handle:
            data = handle.read()
    except FileNotFoundError:
        raise UserError(f"{path}: the record resumes from iteration {iteration}, whose checkpoint is missing") from None
    except OSError as err:
        raise UserError(f"{path}: not readable ({err.strerror or err})") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise UserError(
            f"{path}: sha256 {digest[:16]}..., the record resumes from {sha256[:16]}...: refusing to load it"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch.load's errors of a damaged file vary (pickle, zip, runtime)
        raise UserError(f"{path}: not a checkpoint torch can read ({type(err).__name__})") from None
    if not isinstance(state, dict) or state.get("iteration") != iteration:
        raise UserError(
            f"{path}: holds iteration {state.get('iteration') if isinstance(state, dict) else None}, "
            f"the record resumes from {iteration}"
        )
    getattr(model, "module", model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_state"])
    return iteration
