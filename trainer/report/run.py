"""A run as the reports read it: its steps (``metrics.jsonl``), its typed composition and its record, from a run
directory (:mod:`trainer.record.rundir` names its files and reads each) or from a ``metrics.jsonl`` file alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from trainer.compose import schema
from trainer.errors import UserError
from trainer.record.record import RunRecord
from trainer.record.rundir import CONFIG, load_config, load_record, train_config_of
from trainer.report.metrics import Step, read_metrics


@dataclass
class Run:
    """A run as the reports see it. ``config``/``cfg`` are None when only a metrics file was given."""

    path: Path  # the directory, or the metrics file
    steps: list[Step]
    cfg: DictConfig | None = None  # the resolved composition, typed
    config: schema.TrainConfig | None = None
    record: RunRecord | None = None

    @property
    def cpu_only(self) -> bool:
        """True when the record has probes and none of its ranks saw a GPU (a ``launcher=local-cpu`` run)."""
        probes = ((self.record.get("probe") if self.record else None) or {}).get("ranks") or []
        return bool(probes) and not any((p.get("torch") or {}).get("gpus") for p in probes)

    @property
    def train_config(self) -> schema.TrainConfig:
        """:attr:`config` of a run loaded with its config (:func:`load_run` with ``need_config``); raises
        :class:`UserError` for a run without one."""
        if self.config is None:
            raise UserError(f"{self.path}: no config.yaml (not a run directory written by `train`)")
        return self.config

    @property
    def composition(self) -> DictConfig:
        """:attr:`cfg` of a run loaded with its config (:func:`load_run` with ``need_config``); raises
        :class:`UserError` for a run without one."""
        if self.cfg is None:
            raise UserError(f"{self.path}: no config.yaml (not a run directory written by `train`)")
        return self.cfg

    @property
    def directory(self) -> Path | None:
        """The run directory, or None when only a ``metrics.jsonl`` file was given."""
        return self.path if self.path.is_dir() else None

    @property
    def label(self) -> str:
        """A short name for tables and plots: the layout label from the config, else the directory's name (for a
        metrics file, its parent directory's name).
        """
        if self.config is not None:
            return self.config.layout.label
        return self.path.parent.name if self.path.is_file() else self.path.name


def load_run(path: Path, need_config: bool = False, need_metrics: bool = True) -> Run:
    """Load a run directory (or a ``metrics.jsonl`` file when ``need_config`` is false).

    Raises :class:`UserError` when ``path`` is missing, when a config is needed but absent, or on any
    bad file inside.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such run directory or file")
    if path.is_file():
        if need_config:
            raise UserError(f"{path}: a run directory is needed here (config.yaml, record.json, metrics.jsonl)")
        return Run(path=path, steps=read_metrics(path))
    config_path = path / CONFIG
    cfg = load_config(config_path) if config_path.exists() else None
    if need_config and cfg is None:
        raise UserError(f"{path}: no config.yaml (not a run directory written by `train`)")
    steps = read_metrics(path) if need_metrics else []
    return Run(
        path=path,
        steps=steps,
        cfg=cfg,
        config=train_config_of(cfg) if cfg is not None else None,
        record=load_record(path),
    )
