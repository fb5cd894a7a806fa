"""Checkpoints of the CPU worker's training, in Megatron's layout, and the choice of the one to resume from.

Layout (Megatron-LM ``megatron/training/checkpointing.py``, ``get_checkpoint_name`` and the tracker file): under
``RUN_DIR/checkpoints/`` (Megatron's ``--save``), one folder per saved iteration ``iter_0000004/`` holding
``mp_rank_00/model_optim_rng.pt`` (one model-parallel rank: the CPU worker's ranks are data-parallel replicas,
so rank 0 saves for all), and ``latest_checkpointed_iteration.txt`` naming the newest iteration, written after
it. A save writes the folder under a temporary name and renames it; the tracker is replaced atomically: a kill
at any point leaves the previous checkpoint current.

The file is ``torch.save`` of ``{"iteration", "model", "optimizer", "rng_state", "checkpoint_version"}``:
the model's and AdamW's ``state_dict()``, torch's CPU generator state. The host never loads it (that would
unpickle what the run wrote); it chooses one by the tracker and checks its bytes against the sha256 the
previous attempt's record holds (:func:`trainer.record.attempts.vouched_checkpoint`) before a ``--resume``
starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import UserError
from trainer.publish import atomic_write
from trainer.record.attempts import TRACKER, latest_iteration
from trainer.record.names import CHECKPOINTS, checkpoint_state

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
    latest; ``model`` unwrapped from DDP when wrapped. Returns the checkpoint file. The folder is written under
    a temporary name and renamed; then the tracker (atomically). Raises ``OSError`` from the file system."""
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


def load(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the latest checkpoint (the tracker's) into ``model`` (unwrapped from DDP when wrapped) and
    ``optimizer`` and restore torch's CPU generator; returns its iteration, 0 (nothing loaded) when the run
    directory has none. Raises :class:`UserError` naming the file when it is missing, unreadable or of another
    iteration."""
    import torch

    iteration = latest_iteration(run_dir)
    if iteration == 0:
        return 0
    path = Path(run_dir) / state_path(iteration)
    try:
        with open(path, "rb") as handle:
            state = torch.load(handle, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: the tracker names iteration {iteration}, whose checkpoint file is missing") from None
    except Exception as err:  # noqa: BLE001 - torch.load's errors of a damaged file vary (pickle, zip, runtime)
        raise UserError(f"{path}: not a checkpoint torch can read ({type(err).__name__})") from None
    if not isinstance(state, dict) or state.get("iteration") != iteration:
        raise UserError(
            f"{path}: holds iteration {state.get('iteration') if isinstance(state, dict) else None}, "
            f"the tracker names {iteration}"
        )
    getattr(model, "module", model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_state"])
    return iteration
