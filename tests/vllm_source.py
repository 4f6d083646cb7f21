"""Running parts of vLLM's own source from its wheel as test oracles, without vLLM's
dependencies: what the loaded files import from the rest of vLLM becomes stub modules whose
every attribute is a plain record class, and vLLM's logger a silent one."""

from __future__ import annotations

import types
from typing import Any


class Record:
    """Stands for a vLLM pydantic model: keeps what it is given or set."""

    def __init__(self, *args: Any, **fields: Any) -> None:
        self.__dict__.update(fields)

    @classmethod
    def model_validate(cls, data: dict[str, Any]) -> Record:
        return cls(**data)


class StubModule(types.ModuleType):
    """A module whose every attribute is a fresh record class (subclassable, callable)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        kind = type(name, (Record,), {})
        setattr(self, name, kind)
        return kind


def stub_module(name: str, **attributes: Any) -> types.ModuleType:
    module = StubModule(name)
    module.__dict__.update(attributes)
    return module


class SilentLogger:
    """vLLM's init_logger(...) result: every call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None
