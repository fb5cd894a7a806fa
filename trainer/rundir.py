"""Reading a run directory: ``config.yaml`` (typed by the schema), ``record.json`` and ``metrics.jsonl``.

A run directory is what ``train`` writes (``hydra.run.dir=DIR``) plus, once the run has executed,
``metrics.jsonl``. Reports accept a directory or, where only the steps matter, a ``metrics.jsonl`` file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer import schema
from trainer.errors import UserError
from trainer.metrics import Step, read_metrics


@dataclass
class Run:
    """A run as the reports see it. ``config``/``cfg`` are None when only a metrics file was given."""

    path: Path  # the directory, or the metrics file
    steps: List[Step]
    cfg: Optional[DictConfig] = None  # the resolved composition, typed
    config: Optional[schema.TrainConfig] = None
    record: Optional[Dict[str, Any]] = None

    @property
    def cpu_only(self) -> bool:
        """True when the record has probes and none of its ranks saw a GPU (a ``launcher=local-cpu`` run)."""
        probes = ((self.record or {}).get("probe") or {}).get("ranks") or []
        return bool(probes) and not any((p.get("torch") or {}).get("gpus") for p in probes)

    @property
    def directory(self) -> Optional[Path]:
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


def load_config(path: Path) -> DictConfig:
    """``config.yaml`` of a run merged into the schema (:class:`trainer.schema.TrainConfig`).

    Raises :class:`UserError` naming the file on unreadable YAML, unknown keys, wrong types or missing values.
    """
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as ex:
        raise UserError(f"{path}: not readable YAML ({str(ex).splitlines()[0]})") from None
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
    return cfg


def load_record(directory: Path) -> Optional[Dict[str, Any]]:
    """``record.json`` of a run directory, or None if it has none; raises :class:`UserError` if unreadable."""
    path = directory / "record.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as ex:
        raise UserError(f"{path}: not readable JSON ({ex})") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}: expected a JSON object")
    return record


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
    config_path = path / "config.yaml"
    cfg = load_config(config_path) if config_path.exists() else None
    if need_config and cfg is None:
        raise UserError(f"{path}: no config.yaml (not a run directory written by `train`)")
    steps = read_metrics(path) if need_metrics else []
    return Run(
        path=path,
        steps=steps,
        cfg=cfg,
        config=OmegaConf.to_object(cfg) if cfg is not None else None,
        record=load_record(path),
    )
