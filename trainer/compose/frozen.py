"""Read-only values for a prepared run: lists, dicts and schema records that refuse to change once frozen.

:func:`freeze` turns a value into one that raises on every in-place change, all the way down: a list becomes a
:class:`FrozenList`, a dict a :class:`FrozenDict` (subclasses of ``list`` and ``dict``, so JSON, equality and
``isinstance`` see what they saw before), a schema record (:class:`Record`, the base of the dataclasses of
:mod:`trainer.compose.schema`) is marked read-only, and a frozen dataclass (``dataclass(frozen=True)``) gets its
fields frozen. A change raises :class:`dataclasses.FrozenInstanceError` (a record's field) or :class:`TypeError`
(a list's or dict's item). Tuples, strings, numbers, enums and None are returned as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NoReturn, TypeVar

T = TypeVar("T")


def _refuse(self: object, *args: Any, **kwargs: Any) -> NoReturn:
    raise TypeError(f"a {type(self).__name__} is read-only (a prepared run does not change)")


class FrozenList(list[Any]):
    """A ``list`` that refuses every in-place change (``append``, ``x[0] = ...``, ``+=``, ``sort``, ...)."""

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    def __reduce__(self) -> tuple[Any, ...]:  # copy and pickle build it whole, not item by item
        return (type(self), (list(self),))


class FrozenDict(dict[Any, Any]):
    """A ``dict`` that refuses every in-place change (``d[k] = ...``, ``update``, ``pop``, ``|=``, ...)."""

    __setitem__ = __delitem__ = __ior__ = _refuse
    update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))


class Record:
    """Base of the schema's dataclasses: mutable while OmegaConf builds an instance
    (``OmegaConf.to_object``), read-only once :func:`freeze` has marked it (``FrozenInstanceError`` on
    assignment). OmegaConf sees a plain dataclass: this class declares no field."""

    _frozen: ClassVar[bool] = False  # set on the instance by freeze()

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r} of a prepared run's config")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r} of a prepared run's config")
        super().__delattr__(name)


def freeze(value: T) -> T:
    """``value`` read-only all the way down (see the module docstring); lists and dicts are copied, records and
    frozen dataclasses are frozen in place and returned. Raises :class:`TypeError` for a mutable object of
    another kind (a set, a dataclass that is neither a record nor frozen), which would be a hole."""
    if isinstance(value, Record):
        for f in dataclasses.fields(value):  # type: ignore[arg-type]  # every Record subclass is a dataclass
            object.__setattr__(value, f.name, freeze(getattr(value, f.name)))
        object.__setattr__(value, "_frozen", True)
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not type(value).__dataclass_params__.frozen:  # type: ignore[attr-defined]  # set by @dataclass
            raise TypeError(f"freeze: {type(value).__name__} is a mutable dataclass")
        for f in dataclasses.fields(value):
            object.__setattr__(value, f.name, freeze(getattr(value, f.name)))
        return value
    if isinstance(value, dict):
        return FrozenDict({k: freeze(v) for k, v in value.items()})  # type: ignore[return-value]  # a dict still
    if isinstance(value, list):
        return FrozenList(freeze(v) for v in value)  # type: ignore[return-value]  # a list still
    if isinstance(value, tuple):
        return tuple(freeze(v) for v in value)  # type: ignore[return-value]  # a tuple still
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return value
    raise TypeError(f"freeze: cannot make a {type(value).__name__} read-only")
