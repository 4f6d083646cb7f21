"""vLLM 0.34's own Responses-to-chat conversion, run from the wheel's source, as an oracle.

``vllm/entrypoints/openai/responses/protocol.py`` (the pydantic ``ResponsesRequest``, with
its input-item normalisation and tool-choice checks) and ``utils.py``
(``construct_input_messages``, ``construct_tool_dicts``, ``should_continue_final_message``)
are loaded as they are, on the installed ``openai`` types; what they import from the rest
of vLLM is stubbed: plain records, and the few vLLM helpers the conversion calls
(``FunctionDefinition``/``ChatCompletionToolsParam``'s dump, ``get_function_tools``'s
flattening, ``map_reasoning_effort``/``merge_kwargs``) copied as small equivalents. No
engine, no torch.

The wheel is a local artefact (var/wheels, not in git): without it the oracle is absent and
the tests that need it skip.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import sys
import types
import zipfile
from typing import Any, Literal

import openai.types.responses  # noqa: F401  (loaded once: the oracle's classes are these)
import pydantic

from testbed.engine_models import vllm_wheel
from tests.vllm_source import Record, SilentLogger, stub_module

_PREFIX = "vllm/entrypoints/openai/responses/"
_FILES = ("protocol.py", "utils.py")
# The harmony path (gpt-oss): vLLM's harmony helpers and its Responses-to-harmony conversion,
# loaded after the files above, and the renderer's method that glues them together.
_HARMONY_UTILS = "vllm/entrypoints/openai/parser/harmony_utils.py"
_HARMONY_FILES = {
    "vllm.entrypoints.openai.parser.harmony_utils": _HARMONY_UTILS,
    "vllm.entrypoints.openai.responses.harmony": _PREFIX + "harmony.py",
}
_RENDERER = "vllm/renderers/online_renderer.py"
_RENDER_METHOD = "_render_responses_with_harmony"


class VLLMValidationError(ValueError):
    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
        super().__init__(message)
        self.parameter = parameter


class OpenAIBaseModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow", arbitrary_types_allowed=True)


class FunctionDefinition(OpenAIBaseModel):
    # vllm/entrypoints/generate/base/protocol.py, its dump included.
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None

    @pydantic.model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        data = {k: v for k, v in data.items() if k in type(self).model_fields}
        if self.strict is None:
            data.pop("strict", None)
        if self.defer_loading is None:
            data.pop("defer_loading", None)
        return data


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def _custom_tool_parameters() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "input": {"type": "string", "description": "The freeform text payload for this tool."}
        },
        "required": ["input"],
        "additionalProperties": False,
    }


def _iter_response_function_tool_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    # vllm/tool_parsers/utils.py: get_function_tools (namespaces aside), then model_dump.
    from openai.types.responses import CustomTool, FunctionTool

    out: list[dict[str, Any]] = []
    for tool in tools:
        if isinstance(tool, CustomTool):
            out.append(
                FunctionTool.model_validate(
                    {
                        "type": "function",
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": _custom_tool_parameters(),
                    }
                ).model_dump()
            )
        elif isinstance(tool, FunctionTool):
            out.append(tool.model_dump())
    return out


def _map_reasoning_effort(effort: str | None, effort_map: dict[str, str] | None) -> str | None:
    if effort is None or not effort_map:
        return effort
    return effort_map.get(effort, effort)


def _merge_kwargs(defaults: dict[str, Any] | None, overrides: dict[str, Any] | None) -> dict:
    merged = dict(defaults or {})
    merged.update({k: v for k, v in (overrides or {}).items() if v not in (None, "auto")})
    return merged


def _load() -> types.ModuleType | None:
    wheel_path = vllm_wheel()  # fetched once from PyPI; None offline
    if wheel_path is None:
        return None
    with zipfile.ZipFile(wheel_path) as wheel:
        sources = {name: wheel.read(_PREFIX + name).decode() for name in _FILES}
        harmony_sources = {
            module: wheel.read(path).decode() for module, path in _HARMONY_FILES.items()
        }
        renderer_source = wheel.read(_RENDERER).decode()
    saved = dict(sys.modules)
    stubs: dict[str, types.ModuleType] = {
        "vllm": stub_module("vllm"),
        "vllm.envs": stub_module(
            "vllm.envs",
            VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS=[],
            VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS=False,
            VLLM_SYSTEM_START_DATE=None,
        ),
        "vllm.config": stub_module("vllm.config"),
        "vllm.entrypoints": stub_module("vllm.entrypoints"),
        "vllm.entrypoints.generate": stub_module("vllm.entrypoints.generate"),
        "vllm.entrypoints.generate.base": stub_module("vllm.entrypoints.generate.base"),
        "vllm.entrypoints.generate.base.protocol": stub_module(
            "vllm.entrypoints.generate.base.protocol",
            MMPayload=Literal["tensors", "none"],
            PerRequestMetrics=dict[str, Any],
            StopParam=str | list[str] | None,
            TopLogprobsParam=int | None,
            resolve_return_mm_kwargs_alias=lambda data: data,
            validate_cache_salt=lambda salt: None,
            FunctionDefinition=FunctionDefinition,
        ),
        "vllm.entrypoints.serve": stub_module("vllm.entrypoints.serve"),
        "vllm.entrypoints.serve.engine": stub_module("vllm.entrypoints.serve.engine"),
        "vllm.entrypoints.serve.engine.protocol": stub_module(
            "vllm.entrypoints.serve.engine.protocol", OpenAIBaseModel=OpenAIBaseModel
        ),
        "vllm.entrypoints.openai": stub_module("vllm.entrypoints.openai"),
        "vllm.entrypoints.openai.parser": stub_module("vllm.entrypoints.openai.parser"),
        "vllm.entrypoints.openai.chat_completion": stub_module(
            "vllm.entrypoints.openai.chat_completion"
        ),
        "vllm.entrypoints.openai.chat_completion.protocol": stub_module(
            "vllm.entrypoints.openai.chat_completion.protocol",
            ChatCompletionMessageParam=dict[str, Any],
            ChatCompletionToolsParam=ChatCompletionToolsParam,
        ),
        "vllm.exceptions": stub_module("vllm.exceptions", VLLMValidationError=VLLMValidationError),
        "vllm.logger": stub_module("vllm.logger", init_logger=lambda name: SilentLogger()),
        "vllm.renderers": stub_module(
            "vllm.renderers", map_reasoning_effort=_map_reasoning_effort, merge_kwargs=_merge_kwargs
        ),
        "vllm.renderers.chat_utils": stub_module(
            "vllm.renderers.chat_utils",
            ChatCompletionMessageParam=dict[str, Any],
            ChatTemplateContentFormatOption=str,
            make_tool_call_id=lambda **kwargs: "call_made_up",
        ),
        "vllm.sampling_params": stub_module("vllm.sampling_params", ThinkingTokenBudget=int | None),
        "vllm.tool_parsers": stub_module("vllm.tool_parsers"),
        "vllm.tool_parsers.utils": stub_module(
            "vllm.tool_parsers.utils",
            CUSTOM_TOOL_INPUT_KEY="input",
            flat_namespace_tool_name=lambda namespace, name: f"{namespace}__{name}",
            iter_response_function_tool_dicts=_iter_response_function_tool_dicts,
        ),
        "vllm.utils": stub_module("vllm.utils", random_uuid=lambda: "0"),
        "partial_json_parser": stub_module("partial_json_parser"),
        "partial_json_parser.core": stub_module("partial_json_parser.core"),
        "partial_json_parser.core.options": stub_module("partial_json_parser.core.options"),
    }
    package = stub_module("vllm.entrypoints.openai.responses")
    package.__path__ = []
    stubs[package.__name__] = package
    for name, module in stubs.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(stubs[parent], child, module)
    try:
        sys.modules.update(stubs)
        loaded = {}
        for file in _FILES:
            name = f"vllm.entrypoints.openai.responses.{file.removesuffix('.py')}"
            spec = importlib.util.spec_from_loader(name, loader=None)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            setattr(package, file.removesuffix(".py"), module)
            exec(compile(sources[file], f"{_PREFIX}{file}", "exec"), module.__dict__)
            loaded[file] = module
        for name, source in harmony_sources.items():
            module = _exec_module(name, source, _HARMONY_FILES[name], stubs)
            loaded[_HARMONY_FILES[name]] = module
        oracle = types.ModuleType("_kvgate_vllm_responses_oracle")
        oracle.harmony_utils = loaded[_HARMONY_UTILS]  # type: ignore[attr-defined]
        oracle.render_with_harmony = _renderer_method(  # type: ignore[attr-defined]
            renderer_source,
            loaded["utils.py"],
            loaded[_PREFIX + "harmony.py"],
            loaded[_HARMONY_UTILS],
        )
        oracle.protocol = loaded["protocol.py"]  # type: ignore[attr-defined]
        oracle.utils = loaded["utils.py"]  # type: ignore[attr-defined]
        # The modules a call imports lazily (build_chat_params imports .utils).
        oracle.modules = {**stubs, **{m.__name__: m for m in loaded.values()}}  # type: ignore[attr-defined]
        return oracle
    finally:
        # Leave no stub behind for other tests (what the files imported for real stays).
        loaded_names = [
            *(f"{package.__name__}.{f.removesuffix('.py')}" for f in _FILES),
            *_HARMONY_FILES,
        ]
        for name in [*stubs, *loaded_names]:
            if name not in saved:
                sys.modules.pop(name, None)
        sys.modules.update(saved)


def _exec_module(
    name: str, source: str, path: str, stubs: dict[str, types.ModuleType]
) -> types.ModuleType:
    """Run one wheel file as module ``name`` (its parent package a stub)."""
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(stubs[parent], child, module)
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def _renderer_method(
    source: str,
    responses_utils: types.ModuleType,
    responses_harmony: types.ModuleType,
    harmony_utils: types.ModuleType,
) -> Any:
    """``OnlineRenderer._render_responses_with_harmony`` as it is in the wheel, compiled on
    its own: the renderer module imports the whole engine, the method only these names."""
    tree = ast.parse(source, _RENDERER)
    method = next(
        node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == _RENDER_METHOD
    )
    from openai.types.responses import ResponseFunctionToolCall
    from openai_harmony import Message

    namespace: dict[str, Any] = {
        **vars(harmony_utils),
        **vars(responses_harmony),
        "OpenAIMessage": Message,
        "ResponseFunctionToolCall": ResponseFunctionToolCall,
        "ResponsesRenderResult": Record,
        "extract_tool_types": responses_utils.extract_tool_types,
        "map_reasoning_effort": _map_reasoning_effort,
        "VLLMValidationError": VLLMValidationError,
    }
    module = ast.Module(body=[method], type_ignores=[])
    exec(compile(module, _RENDERER, "exec"), namespace)
    return namespace[_RENDER_METHOD]


ORACLE = _load()


def _plain(value: Any) -> Any:
    if isinstance(value, pydantic.BaseModel):
        value = value.model_dump()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ValidatorIterator":
        return [_plain(v) for v in value]
    return value


def vllm_conversion(body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM renders for ``body``: its chat messages, tools, template keywords and
    whether the last message is continued. Raises pydantic's ValidationError or
    VLLMValidationError when vLLM refuses the body."""
    assert ORACLE is not None
    saved = dict(sys.modules)
    sys.modules.update(ORACLE.modules)
    try:
        # Its validators rewrite the body they are given: a copy of it.
        request = ORACLE.protocol.ResponsesRequest.model_validate(copy.deepcopy(body))
        utils = ORACLE.utils
        messages = utils.construct_input_messages(
            request_instructions=request.instructions, request_input=request.input
        )
        tools = utils.construct_tool_dicts(request.tools, request.tool_choice)
        params = request.build_chat_params(None, "auto")
        continued = utils.should_continue_final_message(request.input)
    finally:
        for name in ORACLE.modules:
            if name not in saved:
                sys.modules.pop(name, None)
        sys.modules.update(saved)
    return {
        "messages": _plain(messages),
        "tools": _plain(tools),
        "tool_choice": request.tool_choice,
        "chat_template_kwargs": params.chat_template_kwargs,
        "continue_final": continued,
    }


class HarmonyRefusal(Exception):
    """vLLM answers the body with an error instead of a prompt."""


class _Renderer:
    """What ``_render_responses_with_harmony`` reads of the renderer: no reasoning-effort
    map, no parser (its ``adjust_request`` shapes sampling, not the prompt), and the
    prompt rendered by vLLM's ``render_for_completion``."""

    reasoning_effort_map: dict[str, str] = {}
    model_config = Record(max_model_len=1 << 30)

    def adjust_harmony_request(self, request: Any) -> None:
        return None

    def _get_harmony_builtin_tool_descriptions(self, *args: Any) -> dict[str, Any]:
        # Without a tool server no built-in tool is described.
        assert ORACLE is not None
        labels = ORACLE.harmony_utils.BUILTIN_TOOL_TO_MCP_SERVER_LABEL
        return {f"{server}_description": None for server in labels}

    def create_error_response(self, message: str, **kwargs: Any) -> Any:
        raise HarmonyRefusal(message)

    def render_responses_harmony_messages(self, messages: list[Any], **kwargs: Any) -> Any:
        assert ORACLE is not None
        return list(ORACLE.harmony_utils.render_for_completion(messages))


def vllm_harmony_prompt(
    body: dict[str, Any], reasoning_effort_map: dict[str, str] | None = None
) -> list[int]:
    """The prompt token ids vLLM 0.34 runs for ``body`` on a gpt-oss model (no tool
    server, no stored history; the server's ``--reasoning-effort-map``). Raises
    HarmonyRefusal, VLLMValidationError or pydantic's ValidationError when vLLM refuses
    the body."""
    assert ORACLE is not None
    saved = dict(sys.modules)
    sys.modules.update(ORACLE.modules)
    try:
        request = ORACLE.protocol.ResponsesRequest.model_validate(copy.deepcopy(body))
        if request.is_include_output_logprobs():
            # serving.py's _validate_create_responses_input, before rendering.
            raise HarmonyRefusal("logprobs are not supported with gpt-oss models")
        renderer = _Renderer()
        renderer.reasoning_effort_map = dict(reasoning_effort_map or {})
        result = ORACLE.render_with_harmony(
            renderer,
            request,
            previous_messages=None,
            previous_response_outputs=None,
            tool_server=None,
        )
    finally:
        for name in ORACLE.modules:
            if name not in saved:
                sys.modules.pop(name, None)
        sys.modules.update(saved)
    prompt: list[int] = result.engine_input
    return prompt
