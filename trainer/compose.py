"""Compose runs from ``conf/`` with Hydra's Compose API, and report composition errors on one line.

``trainer.train`` composes every job of a command line here first (a multirun sweep is expanded into
its jobs), checks each one, and only then hands control to ``@hydra.main``: a bad override or a
failing check stops the whole command before any run directory is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer import REPO_ROOT, schema
from trainer.errors import UserError
from trainer.redact import redact_argv

CONF_DIR = REPO_ROOT / "conf"
CONFIG_NAME = "train"


def describe_error(ex: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error: what was wrong and where.

    ``ex`` is a ``HydraException`` or ``OmegaConfBaseException``; the innermost OmegaConf cause gives
    the message and its ``full_key``. Unknown group options list the available ones on the same line.
    """
    if isinstance(ex, MissingConfigException):
        text = str(ex)
        head = text.splitlines()[0]
        options = getattr(ex, "options", None)
        if options:
            head += f" (available: {', '.join(sorted(options))})"
        return head
    cause: Optional[BaseException] = ex
    while cause is not None and not isinstance(cause, OmegaConfBaseException) and cause.__cause__ is not None:
        cause = cause.__cause__
    head = str(ex).splitlines()[0] if str(ex) else type(ex).__name__
    if isinstance(cause, OmegaConfBaseException) and cause is not ex:
        msg = getattr(cause, "msg", None) or str(cause).splitlines()[0]
        key = getattr(cause, "full_key", None)
        where = f" (key: {key})" if key else ""
        return f"{head}: {msg.splitlines()[0]}{where}"
    if isinstance(ex, OmegaConfBaseException):
        msg = getattr(ex, "msg", None) or head
        key = getattr(ex, "full_key", None)
        return f"{msg.splitlines()[0]}" + (f" (key: {key})" if key else "")
    return " ".join(head.split())


def unknown_keys(cfg: DictConfig, node_type: type = schema.TrainConfig, prefix: str = "") -> List[str]:
    """Dotted keys of ``cfg`` that the schema dataclass ``node_type`` does not declare (recursively).

    OmegaConf lets a ``+key=value`` override add keys to a structured node; this catches them.
    """
    fields = {f.name: f for f in dataclasses.fields(node_type)}
    bad: List[str] = []
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if key not in fields:
            bad.append(dotted)
            continue
        sub_type = fields[key].type
        sub = cfg._get_node(key)
        if isinstance(sub, DictConfig) and not sub._is_missing() and not sub._is_none():
            target = getattr(schema, sub_type, None) if isinstance(sub_type, str) else sub_type
            if dataclasses.is_dataclass(target):
                bad += unknown_keys(sub, target, dotted + ".")
    return bad


def expand_sweep(overrides: Sequence[str]) -> List[List[str]]:
    """The jobs of a command line: ``["layout=a,b", "x=1"]`` -> ``[["layout=a", "x=1"], ["layout=b", "x=1"]]``.

    Uses Hydra's override grammar (sweeps ``a,b``, ``range()``, ``choice()``, ``glob()``); raises
    :class:`UserError` on an override that does not parse.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parser = OverridesParser.create()
    for override in overrides:  # one at a time first, so that an error names the override that caused it
        try:
            parser.parse_overrides([override])
        except HydraException as ex:
            raise UserError(f"override {redact_argv([override])[0]!r}: {describe_error(ex)}") from None
    try:
        parsed = parser.parse_overrides(list(overrides))
        batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    except HydraException as ex:
        raise UserError(describe_error(ex)) from None
    return [list(job) for batch in batches for job in batch]


def compose_run(overrides: Sequence[str] = (), conf_dir: Path = CONF_DIR) -> DictConfig:
    """Compose ``conf/train.yaml`` with ``overrides`` and reject keys the schema lacks.

    Returns the composition (interpolations unresolved, as Hydra gives it to the app).
    Raises :class:`UserError` with one line for any composition error.
    """
    schema.register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(conf_dir), version_base="1.3", job_name="train"):
            cfg = compose(CONFIG_NAME, overrides=[o for o in overrides if not o.startswith(("hydra.", "hydra/"))])
    except (HydraException, OmegaConfBaseException) as ex:
        raise UserError(describe_error(ex)) from None
    finally:
        GlobalHydra.instance().clear()
    validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> schema.TrainConfig:
    """Schema validation of a composition: no unknown keys, no missing values, every value resolvable.

    Returns the typed :class:`~trainer.schema.TrainConfig`; raises :class:`UserError` with one line.
    """
    extra = unknown_keys(cfg)
    if extra:
        raise UserError(f"{extra[0]}: unknown key (not in the schema of trainer.schema)")
    try:
        return schema.to_object(cfg)
    except OmegaConfBaseException as ex:
        raise UserError(describe_error(ex)) from None


def as_container(cfg: DictConfig) -> Any:
    """The composition as plain, resolved Python data (for JSON/YAML output)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
