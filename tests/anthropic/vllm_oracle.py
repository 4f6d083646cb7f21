"""vLLM 0.34's own Anthropic-to-chat conversion, run from the wheel's source, as an oracle.

``vllm/entrypoints/anthropic/protocol.py`` (the pydantic request models) is loaded as it
is; ``serving.py`` is loaded with everything it imports but those models stubbed: the chat
request types become plain records, so ``to_chat_completion_request`` runs its real code
and hands back what it set. Only the conversion is exercised (no engine, no torch).

The wheel is a local artefact (var/wheels, not in git): without it the oracle is absent
and the tests that need it skip.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import zipfile
from typing import Any, Literal

from testbed.engine_models import vllm_wheel
from tests.vllm_source import Record, SilentLogger, stub_module

_FILES = ("protocol.py", "serving.py")
_PREFIX = "vllm/entrypoints/anthropic/"
_NAME = "_kvgate_vllm_oracle"


def plain(value: Any) -> Any:
    """Records and containers as plain JSON-like values, null fields dropped."""
    if isinstance(value, Record):
        value = value.__dict__
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def _load() -> types.ModuleType | None:
    wheel_path = vllm_wheel()  # fetched once from PyPI; None offline
    if wheel_path is None:
        return None
    with zipfile.ZipFile(wheel_path) as wheel:
        sources = {name: wheel.read(_PREFIX + name).decode() for name in _FILES}
    saved = dict(sys.modules)
    stubs = {
        "vllm": stub_module("vllm"),
        "vllm.envs": stub_module("vllm.envs", VLLM_MAX_STOP_STRINGS=4),
        "vllm.entrypoints": stub_module("vllm.entrypoints"),
        "vllm.entrypoints.generate": stub_module("vllm.entrypoints.generate"),
        "vllm.entrypoints.generate.base": stub_module("vllm.entrypoints.generate.base"),
        "vllm.entrypoints.generate.base.protocol": stub_module(
            "vllm.entrypoints.generate.base.protocol",
            MMPayload=Literal["tensors", "none"],
            resolve_return_mm_kwargs_alias=lambda data: data,
        ),
        "vllm.logger": stub_module("vllm.logger", init_logger=lambda name: SilentLogger()),
        "fastapi": stub_module("fastapi"),
    }
    for name in (
        "vllm.config",
        "vllm.engine",
        "vllm.engine.protocol",
        "vllm.entrypoints.openai",
        "vllm.entrypoints.openai.chat_completion",
        "vllm.entrypoints.openai.chat_completion.protocol",
        "vllm.entrypoints.openai.chat_completion.serving",
        "vllm.entrypoints.openai.models",
        "vllm.entrypoints.openai.models.serving",
        "vllm.entrypoints.serve",
        "vllm.entrypoints.serve.engine",
        "vllm.entrypoints.serve.engine.protocol",
        "vllm.entrypoints.serve.exception_handling",
        "vllm.entrypoints.serve.exception_handling.utils",
        "vllm.entrypoints.serve.utils",
        "vllm.entrypoints.serve.utils.request_logger",
        "vllm.renderers",
        "vllm.renderers.chat_utils",
        "vllm.renderers.hf",
        "vllm.renderers.inputs",
        "vllm.renderers.inputs.preprocess",
        "vllm.renderers.online_renderer",
        "vllm.renderers.params",
    ):
        stubs[name] = stub_module(name)
    package = stub_module("vllm.entrypoints.anthropic")
    package.__path__ = []
    stubs[package.__name__] = package
    for name, module in stubs.items():
        parent, _, child = name.rpartition(".")
        if parent:
            # `import vllm.envs as envs` reads the attribute of the parent package.
            setattr(stubs[parent], child, module)
    try:
        sys.modules.update(stubs)
        loaded = {}
        for file in _FILES:
            name = f"vllm.entrypoints.anthropic.{file.removesuffix('.py')}"
            spec = importlib.util.spec_from_loader(name, loader=None)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            exec(compile(sources[file], f"{_PREFIX}{file}", "exec"), module.__dict__)
            loaded[file] = module
        oracle = types.ModuleType(_NAME)
        oracle.protocol = loaded["protocol.py"]  # type: ignore[attr-defined]
        oracle.serving = loaded["serving.py"]  # type: ignore[attr-defined]
        return oracle
    finally:
        # Leave no stub behind for other tests.
        for name in list(sys.modules):
            if name not in saved:
                del sys.modules[name]
        sys.modules.update(saved)


ORACLE = _load()


def vllm_chat_request(body: dict[str, Any], *, disabled_thinking_effort: str = "none") -> Any:
    """The chat request vLLM converts ``body`` into, as plain values; raises pydantic's
    ValidationError (or the conversion's ValueError) when vLLM refuses the body."""
    assert ORACLE is not None
    request = ORACLE.protocol.AnthropicMessagesRequest.model_validate(body)
    chat = ORACLE.serving.AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=False, disabled_thinking_effort=disabled_thinking_effort
    )
    return plain(chat)
