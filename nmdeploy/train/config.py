"""Training run configuration: typed dataclasses read from TOML and validated before any work starts.

A config file has three tables, ``[task]``, ``[train]`` and ``[sparsity]``; every key has a default except the task
name. Unknown tables or keys are errors that list the valid ones, so a typo never silently trains the wrong recipe.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmdeploy.errors import InputError
from nmdeploy.limits import MAX_EPOCHS, read_toml
from nmdeploy.train.masking.settings import SparsityConfig
from nmdeploy.train.tasks import TASKS, TaskConfig

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("constant", "cosine")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation recipe, shared by dense and sparse runs so that comparisons are like for like."""

    epochs: int = 20
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float = 3e-3
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: str = "cosine"
    warmup_epochs: int = 0
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 1  # epochs between checkpoints; the last epoch is always saved


@dataclass(frozen=True)
class RunConfig:
    task: TaskConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples) that ``config_from_dict`` reads back; stored in every checkpoint."""
        return {
            "task": dataclasses.asdict(self.task),
            "train": dataclasses.asdict(self.train),
            "sparsity": {
                k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self.sparsity).items()
            },
        }


_TABLES: dict[str, type] = {"task": TaskConfig, "train": TrainConfig, "sparsity": SparsityConfig}


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a TOML run configuration."""
    path = Path(path)
    try:
        data = read_toml(path, "training config")
    except FileNotFoundError as error:
        raise InputError(f"{path}: no such config file") from error
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise InputError(f"{path}: not a readable TOML file ({error})") from error
    try:
        return config_from_dict(data)
    except InputError as error:
        raise InputError(f"{path}: {error}") from error


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a :class:`RunConfig` from parsed TOML (or a checkpoint's stored copy), checking every value."""
    _reject_unknown(data, _TABLES, "table")
    if "task" not in data:
        raise InputError(
            "missing [task] table; give [task] name = one of " + ", ".join(TASKS) + ", or model and data import paths"
        )
    parts = {name: _build(cls, data.get(name, {}), name) for name, cls in _TABLES.items()}
    config = RunConfig(**parts)
    _validate(config)
    return config


def _build(cls: type, values: Any, table: str) -> Any:
    if not isinstance(values, dict):
        raise InputError(f"[{table}] must be a table, not {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _reject_unknown(values, fields, f"key in [{table}]")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _coerce(value, hints[name], f"[{table}] {name}")
    missing = [f.name for f in fields.values() if f.name not in kwargs and _required(f)]
    if missing:
        raise InputError(f"[{table}] needs {', '.join(missing)}")
    return cls(**kwargs)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a field's type; TOML arrays become tuples and a lone string a 1-tuple of strings."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _coerce(value, hint, where)
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
            raise InputError(f"{where} must be a string or a list of strings, not {value!r}")
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise InputError(f"{where} must be a table, not {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{where} must be a finite number, not {value!r}")
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise InputError(f"{where} must be {hint.__name__}, not {value!r}")
    return value


def _reject_unknown(values: dict[str, Any], valid: dict[str, Any], what: str) -> None:
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise InputError(f"unknown {what} {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")


def _one_of(value: str, choices: tuple[str, ...], where: str) -> None:
    if value not in choices:
        raise InputError(f"{where} = {value!r} is not one of {', '.join(choices)}")


def _validate(config: RunConfig) -> None:
    config.task.check()
    train = config.train
    for name in ("epochs", "batch_size", "checkpoint_every"):
        if getattr(train, name) < 1:
            raise InputError(f"[train] {name} must be at least 1, not {getattr(train, name)}")
    if train.epochs > MAX_EPOCHS:
        raise InputError(f"[train] epochs = {train.epochs} is more than nmdeploy runs (at most {MAX_EPOCHS}); fix it")
    if not train.lr > 0:
        raise InputError(f"[train] lr must be positive, not {train.lr}")
    if train.weight_decay < 0 or not 0 <= train.momentum < 1:
        raise InputError("[train] weight_decay must be >= 0 and momentum in [0, 1)")
    if not 0 <= train.warmup_epochs < train.epochs:
        raise InputError(f"[train] warmup_epochs must be in [0, epochs), not {train.warmup_epochs}")
    _one_of(train.optimizer, OPTIMIZERS, "[train] optimizer")
    _one_of(train.schedule, SCHEDULES, "[train] schedule")
    _one_of(train.device, DEVICES, "[train] device")
    config.sparsity.check()
    if config.sparsity.method == "step" and train.optimizer != "adam":
        raise InputError("[sparsity] method 'step' freezes Adam's second moment; use [train] optimizer = 'adam'")
