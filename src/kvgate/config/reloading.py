"""How a change of each configuration field reaches the running process, said where the
field is defined.

Every leaf field of the config model (kvgate.config.model) is typed `Reload[T]` or
`Restart[T]`:

- RELOAD: read from the swapped snapshot on each request, or re-applied by the reloader
  (kvgate.reload) right after the swap;
- RESTART: read once at start-up, so a reload that changes it is refused, naming the field,
  and the old config keeps serving: a half-applied change (e.g. a renew interval from the new
  lease TTL while the store keeps the old one) is worse than none.

`field_classes` reads them back as one table by path ("*" for any list item or mapping key),
which the reloader checks a new config against. A section (a nested model) has no class of
its own: its leaves say theirs. tests/session/test_reload.py walks the config model: a leaf
without one fails there.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel

RELOAD = "reload"
RESTART = "restart"


@dataclass(frozen=True, slots=True)
class AppliedBy:
    """The field's reload class (RELOAD or RESTART), as pydantic metadata: it changes
    neither validation nor the schema."""

    kind: str


_T = TypeVar("_T")
Reload = Annotated[_T, AppliedBy(RELOAD)]
Restart = Annotated[_T, AppliedBy(RESTART)]


def field_classes(model: type[BaseModel]) -> dict[str, str]:
    """Every leaf field of `model` by path, with the reload class its definition declares,
    in declaration order. A leaf that declares none is left out."""
    classes: dict[str, str] = {}
    _walk(model, "", (), classes)
    return classes


def _walk(annotation: Any, path: str, metadata: tuple[Any, ...], out: dict[str, str]) -> None:
    marks = [mark.kind for mark in metadata if isinstance(mark, AppliedBy)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if marks:
            raise TypeError(f"{path}: a section has no reload class; its fields say theirs")
        for name, info in annotation.model_fields.items():
            field_path = f"{path}.{name}" if path else name
            _walk(info.annotation, field_path, tuple(info.metadata), out)
        return
    origin = typing.get_origin(annotation)
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if origin in (list, dict) and _holds_model(args[-1]):
        _walk(args[-1], f"{path}.*", tuple(metadata), out)
    elif origin in (typing.Union, types.UnionType) and any(_holds_model(arg) for arg in args):
        (section,) = [arg for arg in args if _holds_model(arg)]
        _walk(section, path, tuple(metadata), out)
    elif marks:
        if len(marks) > 1:
            raise TypeError(f"{path}: more than one reload class")
        out[path] = marks[0]


def _holds_model(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(arg) for arg in typing.get_args(annotation))
