"""POST /v1/messages and /v1/messages/count_tokens as vLLM 0.34 serves them.

Where vLLM's own code can answer, it does: its Anthropic request models and its conversion to
a chat completion (``vllm/entrypoints/anthropic/{protocol,serving}.py``) are loaded from the
wheel in var/wheels with everything else they import stubbed (the chat request types become
plain records), so a refusal is compared with the errors vLLM's models raise and a Messages
request's prompt with the chat request vLLM builds from it. Without the wheel those tests skip;
the rest pin the same behaviour by hand.
"""

from __future__ import annotations

import json
import sys
import types
import zipfile
from typing import Any, Literal

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from testbed.engine_models import (
    deepseek_v4_model_dir,
    gpt_oss_model_dir,
    mistral_tekken_model_dir,
    vllm_wheel,
)
from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, MODEL, stats
from vllm_sim import SimConfig, create_app, get_sim
from vllm_sim.anthropic import AnthropicRoutes
from vllm_sim.anthropic_protocol import AnthropicMessagesRequest, body_errors, validation_error_body

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
HI = [{"role": "user", "content": "Hello there, how are you?"}]


# --- vLLM's own Anthropic modules, out of the wheel ------------------------------------------


class _Record:
    """Stands for every vLLM class the two modules use but do not define."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    @classmethod
    def model_validate(cls, data: dict[str, Any]) -> _Record:
        return cls(**data)


class _Stubs(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        made = type(name, (_Record,), {})
        setattr(self, name, made)
        return made


class _Quiet:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


_STUBBED = (
    "fastapi",
    "vllm.config",
    "vllm.engine.protocol",
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.openai.models.serving",
    "vllm.entrypoints.serve.engine.protocol",
    "vllm.entrypoints.serve.exception_handling.utils",
    "vllm.entrypoints.serve.utils.request_logger",
    "vllm.renderers.chat_utils",
    "vllm.renderers.hf",
    "vllm.renderers.inputs.preprocess",
    "vllm.renderers.online_renderer",
    "vllm.renderers.params",
)


def _load_vllm() -> types.SimpleNamespace | None:
    wheel_path = vllm_wheel()  # fetched once from PyPI; None offline
    if wheel_path is None:
        return None
    prefix = "vllm/entrypoints/anthropic/"
    with zipfile.ZipFile(wheel_path) as wheel:
        sources = {n: wheel.read(prefix + n + ".py").decode() for n in ("protocol", "serving")}
    modules: dict[str, types.ModuleType] = {}

    def module(name: str, **attributes: Any) -> types.ModuleType:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            modules.setdefault(".".join(parts[:i]), _Stubs(".".join(parts[:i])))
        modules[name].__dict__.update(attributes)
        return modules[name]

    for name in _STUBBED:
        module(name)
    module("vllm.envs", VLLM_MAX_STOP_STRINGS=4)
    module("vllm.logger", init_logger=lambda name: _Quiet())
    module(
        "vllm.entrypoints.generate.base.protocol",
        MMPayload=Literal["tensors", "none"],
        resolve_return_mm_kwargs_alias=lambda data: data,
    )
    module("vllm.entrypoints.anthropic").__path__ = []  # type: ignore[attr-defined]
    for name, mod in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, mod)
    saved = dict(sys.modules)
    loaded: dict[str, types.ModuleType] = {}
    try:
        sys.modules.update(modules)
        for short, source in sources.items():
            name = f"vllm.entrypoints.anthropic.{short}"
            mod = types.ModuleType(name)
            sys.modules[name] = mod
            exec(compile(source, prefix + short + ".py", "exec"), mod.__dict__)
            loaded[short] = mod
    finally:
        for name in list(sys.modules):
            if name not in saved:
                del sys.modules[name]
        sys.modules.update(saved)
    return types.SimpleNamespace(**loaded)


VLLM = _load_vllm()
needs_vllm = pytest.mark.skipif(VLLM is None, reason="vLLM 0.34's wheel is not in var/wheels")


def _plain(value: Any) -> Any:
    if isinstance(value, _Record):
        value = value.__dict__
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def vllm_refusal(body: Any) -> dict[str, Any]:
    """The 400 body vLLM answers ``body`` with: its request model's errors, as FastAPI
    reports them, through vLLM's validation handler."""
    assert VLLM is not None
    with pytest.raises(ValidationError) as caught:
        VLLM.protocol.AnthropicMessagesRequest.model_validate(body)
    return validation_error_body(body_errors(caught.value.errors(include_url=False)))


def vllm_chat_body(body: dict[str, Any], *, merge_inline_system: bool) -> dict[str, Any]:
    """The chat completion request vLLM builds from a Messages request, as a JSON body."""
    assert VLLM is not None
    request = VLLM.protocol.AnthropicMessagesRequest.model_validate(body)
    chat = _plain(
        VLLM.serving.AnthropicServingMessages.to_chat_completion_request(
            request, merge_inline_system=merge_inline_system, disabled_thinking_effort="none"
        )
    )
    keys = ("model", "messages", "tools", "tool_choice", "reasoning_effort")
    return {k: chat[k] for k in (*keys, "chat_template_kwargs") if k in chat}


# --- helpers ---------------------------------------------------------------------------------


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": HI, **extra}


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs; asserts the framing (named events, no [DONE])."""
    assert raw.endswith(b"\n\n"), raw[-60:]
    out = []
    for frame in raw[:-2].split(b"\n\n"):
        name, data = frame.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: "), frame
        event = name[len(b"event: ") :].decode()
        payload = json.loads(data[len(b"data: ") :])
        assert payload["type"] == event
        out.append((event, payload))
    return out


async def post_json(client: TestClient, path: str, data: Any, **kw: Any) -> tuple[int, Any]:
    resp = await client.post(path, json=data, **kw)
    return resp.status, json.loads(await resp.read())


async def chat_prompt_tokens(client: TestClient, chat: dict[str, Any]) -> int:
    status, data = await post_json(client, CHAT, {**chat, "max_tokens": 1})
    assert status == 200, data
    return int(data["usage"]["prompt_tokens"])


async def message_input_tokens(client: TestClient, request: dict[str, Any]) -> int:
    status, data = await post_json(client, MESSAGES, request)
    assert status == 200, data
    status, counted = await post_json(client, COUNT, {"model": MODEL, **_count_fields(request)})
    assert status == 200, counted
    assert counted == {
        "input_tokens": data["usage"]["input_tokens"],
        "context_management": {"original_input_tokens": data["usage"]["input_tokens"]},
    }
    return int(data["usage"]["input_tokens"])


def _count_fields(request: dict[str, Any]) -> dict[str, Any]:
    keep = ("messages", "system", "tools", "tool_choice", "thinking", "output_config")
    keep += ("chat_template_kwargs",)
    return {k: v for k, v in request.items() if k in keep}


# --- request validation ----------------------------------------------------------------------


async def test_missing_max_tokens_is_fastapis_400_in_the_openai_shape(client: TestClient) -> None:
    """FastAPI validates the body before vLLM's Anthropic handler runs: vLLM's generic
    validation handler answers, in its OpenAI error shape."""
    resp = await client.post(MESSAGES, json={"model": MODEL, "messages": HI})
    assert resp.status == 400
    assert resp.headers["Content-Type"] == "application/json"
    assert await resp.read() == (
        b'{"error":{"message":"1 validation error:\\n  {\'type\': \'missing\', '
        b"'loc': 'body.max_tokens', 'msg': 'Field required', 'input': '<dict of 2 items>'}\","
        b'"type":"Bad Request","param":"body.max_tokens","code":400}}'
    )


async def test_unknown_block_type_reports_both_union_members(client: TestClient) -> None:
    content = [{"type": "document", "source": {}}]
    status, data = await post_json(
        client, MESSAGES, body(messages=[{"role": "user", "content": content}])
    )
    assert status == 400
    assert data["error"]["param"] == "body.messages.0.content"
    allowed = (
        "'text', 'image', 'tool_use', 'tool_result', 'tool_reference', 'thinking', "
        "'redacted_thinking', 'tool_addition' or 'tool_removal'"
    )
    assert data["error"]["message"] == (
        "2 validation errors:\n"
        "  {'type': 'string_type', 'loc': 'body.messages.0.content', "
        "'msg': 'Input should be a valid string', 'input': '<list of 1 items>'}\n"
        "  {'type': 'literal_error', 'loc': 'body.messages.0.content.0.type', "
        f"'msg': \"Input should be {allowed}\", 'input': 'document', "
        f"'ctx': {{'expected': \"{allowed}\"}}}}"
    )


async def test_a_validator_refusal_shows_the_error_and_a_summarised_input(
    client: TestClient,
) -> None:
    status, data = await post_json(client, MESSAGES, body(max_tokens=0))
    assert status == 400
    assert data["error"] == {
        "message": "1 validation error:\n  {'type': 'value_error', 'loc': 'body.max_tokens', "
        "'msg': 'Value error, max_tokens must be positive', 'input': '0', "
        "'ctx': {'error': ValueError('max_tokens must be positive')}}",
        "type": "Bad Request",
        "param": "body.max_tokens",
        "code": 400,
    }


BAD_BODIES: dict[str, Any] = {
    "missing max_tokens": {"model": MODEL, "messages": HI},
    "max_tokens zero": body(max_tokens=0),
    "max_tokens a word": body(max_tokens="many"),
    "empty model": body(model=""),
    "no messages": {"model": MODEL, "max_tokens": 4},
    "unknown block type": body(messages=[{"role": "user", "content": [{"type": "document"}]}]),
    "tool role": body(messages=[{"role": "tool", "content": "x"}]),
    "budget over max_tokens": body(
        max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 2000}
    ),
    "budget under 1024": body(max_tokens=4000, thinking={"type": "enabled", "budget_tokens": 10}),
    "unknown thinking type": body(thinking={"type": "sometimes"}),
    "named tool_choice without a name": body(
        tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "tool"}
    ),
    "tool_choice a string": body(tool_choice="auto"),
    "a server tool": body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
    "a tool without a schema": body(tools=[{"name": "f"}]),
    "too many stop sequences": body(stop_sequences=["a", "b", "c", "d", "e"]),
    "tool_addition in a user turn": body(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "f"}}
                ],
            }
        ]
    ),
    "tool_removal of a definition": body(
        messages=[
            {
                "role": "system",
                "content": [
                    {
                        "type": "tool_removal",
                        "tool": {
                            "type": "tool_definition",
                            "definition": {"name": "f", "input_schema": {}},
                        },
                    }
                ],
            },
            *HI,
        ]
    ),
    "empty cache_salt": body(cache_salt=""),
    "a bad effort": body(output_config={"effort": "extreme"}),
    "not an object": [1, 2],
    "a block without a type": body(messages=[{"role": "user", "content": [{"text": "x"}]}]),
    "stop_sequences a string": body(stop_sequences="END"),
    "stream not a boolean": body(stream="maybe"),
    "metadata a list": body(metadata=["user"]),
    "tool_addition in the system field": body(
        system=[{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "f"}}]
    ),
    "tool_addition without a tool": body(
        messages=[{"role": "system", "content": [{"type": "tool_addition"}]}, *HI]
    ),
}


@needs_vllm
@pytest.mark.parametrize("case", list(BAD_BODIES))
async def test_refusals_match_vllms_request_model(client: TestClient, case: str) -> None:
    status, data = await post_json(client, MESSAGES, BAD_BODIES[case])
    assert status == 400
    assert data == vllm_refusal(BAD_BODIES[case])


async def test_body_framing_refusals(client: TestClient) -> None:
    resp = await client.post(
        MESSAGES, data=b'{"model": ', headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.10', "
        "'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
        "'ctx': {'error': 'Expecting value'}}",
        "type": "Bad Request",
        "param": "body.10",
        "code": 400,
    }
    resp = await client.post(
        MESSAGES, data=json.dumps(body()), headers={"Content-Type": "text/plain"}
    )
    media_refusal = await resp.read()
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": "1 validation error:\n  "
        "Unsupported Media Type: Only 'application/json' is allowed",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
    # FastAPI's strict content types: without one the body is not read as JSON at all.
    resp = await client.post(
        MESSAGES, data=json.dumps(body()).encode(), skip_auto_headers=["Content-Type"]
    )
    assert (resp.status, await resp.read()) == (400, media_refusal)


# --- refusals from vLLM's handler: Anthropic's error shape -----------------------------------


def anthropic_error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


async def test_handler_refusals_in_anthropics_shape(make_client: MakeClient) -> None:
    client = await make_client(max_model_len=64)
    cases: list[tuple[dict[str, Any], int, dict[str, Any]]] = [
        (
            body(model="other"),
            404,
            anthropic_error(
                "not_found_error", f"The model `other` does not exist. Valid aliases: {MODEL}."
            ),
        ),
        (
            body(max_tokens=100),
            400,
            anthropic_error(
                "invalid_request_error",
                "max_completion_tokens=100 cannot be greater than max_model_len=64. Please "
                "request fewer output tokens. (parameter=max_completion_tokens, value=100)",
            ),
        ),
        (
            body(messages=[{"role": "user", "content": "word " * 80}]),
            400,
            anthropic_error(
                "invalid_request_error",
                "This model's maximum context length is 64 tokens. However, your prompt "
                "contains at least 65 input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt. "
                "(parameter=input_tokens, value=65)",
            ),
        ),
        (
            body(temperature=3),
            400,
            anthropic_error(
                "invalid_request_error",
                "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)",
            ),
        ),
        (
            body(top_k=-5),
            400,
            anthropic_error(
                "invalid_request_error", "top_k must be 0 (disable), or at least 1, got -5."
            ),
        ),
        (
            body(stop_sequences=[""]),
            400,
            anthropic_error("invalid_request_error", "stop cannot contain an empty string."),
        ),
        (
            body(min_tokens=9),
            400,
            anthropic_error(
                "invalid_request_error",
                "min_tokens must be less than or equal to max_tokens=8, got 9.",
            ),
        ),
        (
            body(
                messages=[
                    {
                        "role": "system",
                        "content": [
                            {
                                "type": "tool_removal",
                                "tool": {"type": "tool_reference", "name": "ghost"},
                            }
                        ],
                    },
                    *HI,
                ]
            ),
            400,
            anthropic_error(
                "invalid_request_error",
                "tool_removal references tool 'ghost', which is not declared in tools",
            ),
        ),
        (
            body(chat_template_kwargs={"chat_template": "{{ 1 }}"}),
            400,
            anthropic_error(
                "invalid_request_error",
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template.",
            ),
        ),
        (
            body(cache_salt="a/b"),
            400,
            anthropic_error(
                "invalid_request_error",
                "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                "'@', '/', '\\\\', or NUL. (parameter=cache_salt)",
            ),
        ),
    ]
    for request, status, expected in cases:
        got_status, got = await post_json(client, MESSAGES, request)
        assert (got_status, got) == (status, expected), request
    # Simulated engine-side statuses come out in Anthropic's vocabulary too.
    for status, kind in ((503, "overloaded_error"), (429, "rate_limit_error"), (500, "api_error")):
        got_status, got = await post_json(
            client, MESSAGES, body(), headers={"x-sim-error": str(status)}
        )
        assert got_status == status
        assert got == anthropic_error(kind, f"Simulated error (x-sim-error: {status})")


async def test_enabled_thinking_needs_a_reasoning_parser(client: TestClient) -> None:
    """The engine refuses a thinking budget without --reasoning-parser: a 400 before any
    answer, or an error event once a stream has answered 200."""
    request = body(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024})
    message = (
        "thinking_token_budget is set but reasoning_config is not configured. Please set "
        "--reasoning-parser and/or --reasoning-config to use thinking_token_budget."
    )
    assert await post_json(client, MESSAGES, request) == (
        400,
        anthropic_error("invalid_request_error", message),
    )
    resp = await client.post(MESSAGES, json={**request, "stream": True})
    assert resp.status == 200
    assert sse_events(await resp.read()) == [
        ("error", anthropic_error("invalid_request_error", message))
    ]
    snap = await stats(client)
    assert snap["running"] == 0 and snap["kv_blocks_used"] == 0


# --- the conversion: the prompt is the chat request vLLM builds ------------------------------

GET_WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_TURNS = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {
                "type": "tool_use",
                "id": "toolu_01",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18C and sunny"},
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]


async def test_system_tool_use_and_tool_result_turns_render_as_the_chat_vllm_builds(
    client: TestClient,
) -> None:
    """Written out by hand: the system prompt leads, the tool call rides on the assistant
    turn (arguments as JSON text), the tool result is a tool message placed before the rest
    of its user turn, and the tools are functions (their schema typed as an object)."""
    request = body(system="Be brief.", messages=TOOL_TURNS, tools=[GET_WEATHER])
    chat = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What's the weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": "toolu_01",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_01", "content": "18C and sunny"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather for a city",
                    "parameters": {**GET_WEATHER["input_schema"], "type": "object"},
                },
            }
        ],
        "tool_choice": "auto",
    }
    expected = await chat_prompt_tokens(client, chat)
    assert await message_input_tokens(client, request) == expected
    # Without the tools the prompt is shorter: they are rendered.
    assert (
        await message_input_tokens(client, body(system="Be brief.", messages=TOOL_TURNS)) < expected
    )


async def test_inline_system_messages_merge_for_a_system_first_template(client: TestClient) -> None:
    """The demo template refuses a system message after the first (raise_exception), so vLLM
    merges inline system texts into the leading one, joined without a separator."""
    request = body(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; hash=abc"},
            {"type": "text", "text": "Be brief."},
        ],
        messages=[
            *HI,
            {"role": "assistant", "content": "Fine."},
            {"role": "system", "content": " Reminder."},
            {"role": "user", "content": "Go on."},
        ],
    )
    chat = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief. Reminder."},
            *HI,
            {"role": "assistant", "content": "Fine."},
            {"role": "user", "content": "Go on."},
        ],
    }
    assert await message_input_tokens(client, request) == await chat_prompt_tokens(client, chat)


CONVERSIONS: dict[str, dict[str, Any]] = {
    "plain": body(),
    "system string": body(system="You are terse."),
    "system blocks with the billing header": body(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=1f2e"},
            {"type": "text", "text": "You are terse. "},
            {"type": "text", "text": "Answer in French."},
        ]
    ),
    "inline system messages": body(
        system="Lead.",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "First reminder."}]},
            *HI,
            {"role": "assistant", "content": [{"type": "text", "text": "Sure."}]},
            {"role": "system", "content": "x-anthropic-billing-header: skip me"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    ),
    "tool turns": body(system="Be brief.", messages=TOOL_TURNS, tools=[GET_WEATHER]),
    "tool result blocks and errors": body(
        tools=[GET_WEATHER],
        messages=[
            *TOOL_TURNS[:2],
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "timeout"},
                            {"type": "text", "text": "retry later"},
                        ],
                    }
                ],
            },
        ],
    ),
    "assistant thinking and a tool result in an assistant turn": body(
        messages=[
            *HI,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Greet back.", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "tool_result", "tool_use_id": "t", "content": "odd"},
                    {"type": "text", "text": "Hi!"},
                ],
            },
            {"role": "user", "content": "Thanks."},
        ]
    ),
    "tool_choice any": body(tools=[GET_WEATHER], tool_choice={"type": "any"}),
    "tool_choice none": body(tools=[GET_WEATHER], tool_choice={"type": "none"}),
    "named tool_choice": body(
        tools=[GET_WEATHER, {"name": "noop", "input_schema": {"type": "object"}, "strict": True}],
        tool_choice={"type": "tool", "name": "noop", "disable_parallel_tool_use": True},
    ),
    "tools added and removed": body(
        tools=[GET_WEATHER, {"name": "later", "input_schema": {}, "defer_loading": True}],
        messages=[
            {
                "role": "system",
                "content": [
                    {
                        "type": "tool_removal",
                        "tool": {"type": "tool_reference", "name": "get_weather"},
                    },
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "later"}},
                    {
                        "type": "tool_addition",
                        "tool": {
                            "type": "tool_definition",
                            "definition": {"name": "fresh", "input_schema": {"type": "object"}},
                        },
                    },
                ],
            },
            *HI,
        ],
    ),
    "an effort": body(output_config={"effort": "high"}),
    "adaptive thinking": body(thinking={"type": "adaptive"}),
    "template keywords": body(chat_template_kwargs={"enable_thinking": False}),
}


@needs_vllm
@pytest.mark.parametrize("case", list(CONVERSIONS))
async def test_prompt_tokens_match_the_chat_request_vllm_builds(
    client: TestClient, case: str
) -> None:
    assert VLLM is not None
    template = json.loads(
        (get_sim(client.app).config.model_dir / "tokenizer_config.json").read_text()
    )["chat_template"]
    # vLLM's own start-up probe decides the merge for the demo template.
    merge = VLLM.serving.AnthropicServingMessages._detect_merge_inline_system(template)
    assert merge is True
    request = CONVERSIONS[case]
    chat = vllm_chat_body(request, merge_inline_system=merge)
    assert await message_input_tokens(client, request) == await chat_prompt_tokens(client, chat)


async def test_disabled_thinking_maps_to_the_effort_the_template_honours(
    client: TestClient,
) -> None:
    """The demo template ignores reasoning_effort, so "none" renders like every effort and
    vLLM's probe settles on "low": the prompt is the plain one either way."""
    plain = await message_input_tokens(client, body())
    assert await message_input_tokens(client, body(thinking={"type": "disabled"})) == plain
    assert await message_input_tokens(client, body(thinking={"type": "between_tools"})) == plain
    routes = AnthropicRoutes(get_sim(client.app))
    request = AnthropicMessagesRequest.model_validate(body(thinking={"type": "disabled"}))
    assert routes.disabled_thinking_effort(request) == "low"
    assert routes.merge_inline_system() is True


@pytest.mark.parametrize(
    ("model_dir", "effort"),
    [
        (deepseek_v4_model_dir, "none"),
        (gpt_oss_model_dir, "low"),
        (mistral_tekken_model_dir, "low"),
    ],
)
async def test_probes_on_the_other_prompt_paths(model_dir: Any, effort: str) -> None:
    """DeepSeek V4 (a thinking switch), harmony (no "none" effort) and Mistral (a tokenizer
    version without reasoning_effort): none of them keeps inline system messages in place, as
    vLLM's renderer probe finds; a disabled thinking maps to "none" where the prompt honours
    it, else to "low" (which this Mistral tokenizer refuses too, as a chat with it would)."""
    client = TestClient(
        TestServer(create_app(SimConfig(model_dir=model_dir(), served_model_name="m")))
    )
    await client.start_server()
    try:
        routes = AnthropicRoutes(get_sim(client.app))
        assert routes.merge_inline_system() is True
        disabled = AnthropicMessagesRequest.model_validate(
            {**body(model="m"), "thinking": {"type": "disabled"}}
        )
        assert routes.disabled_thinking_effort(disabled) == effort
        request = body(model="m", thinking={"type": "disabled"})
        status, data = await post_json(client, MESSAGES, request)
        chat_status, chat = await post_json(
            client,
            CHAT,
            {"model": "m", "messages": HI, "reasoning_effort": effort, "max_tokens": 1},
        )
        assert status == chat_status, (data, chat)
        if status == 200:
            assert data["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        else:
            assert data["error"]["type"] == "invalid_request_error"
    finally:
        await client.close()


# --- the answer ------------------------------------------------------------------------------


async def test_message_shape_and_usage(client: TestClient) -> None:
    resp = await client.post(
        MESSAGES,
        json=body(max_tokens=10),
        headers={"X-Request-Id": "req-7", "x-sim-output-tokens": "4"},
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "application/json"
    raw = await resp.read()
    prompt = await chat_prompt_tokens(client, {"model": MODEL, "messages": HI})
    # The last of the 4 tokens is EOS: counted, never shown; stop_sequence (null) left out.
    assert json.loads(raw) == {
        "id": "chatcmpl-req-7",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": " the cat sat"}],
        "model": MODEL,
        "stop_reason": "end_turn",
        "usage": {"input_tokens": prompt, "output_tokens": 4},
    }
    assert list(json.loads(raw)) == [
        "id",
        "type",
        "role",
        "content",
        "model",
        "stop_reason",
        "usage",
    ]
    assert b": " not in raw  # Starlette's compact JSON
    status, capped = await post_json(client, MESSAGES, body(max_tokens=3))
    assert status == 200
    assert capped["stop_reason"] == "max_tokens"
    assert capped["content"] == [{"type": "text", "text": " the cat sat"}]
    assert capped["usage"] == {"input_tokens": prompt, "output_tokens": 3}
    assert capped["id"].startswith("chatcmpl-") and len(capped["id"]) == len("chatcmpl-") + 32
    # Only EOS generated: the content is still one (empty) text block.
    status, empty = await post_json(client, MESSAGES, body(), headers={"x-sim-output-tokens": "1"})
    assert empty["content"] == [{"type": "text", "text": ""}]
    assert empty["usage"]["output_tokens"] == 1


async def test_engine_abort_leaves_the_stop_reason_out(client: TestClient) -> None:
    status, data = await post_json(
        client, MESSAGES, body(), headers={"x-sim-finish-abort-after": "2"}
    )
    assert status == 200
    assert "stop_reason" not in data
    assert data["usage"]["output_tokens"] == 2


async def test_stream_events_in_order(client: TestClient) -> None:
    resp = await client.post(
        MESSAGES, json=body(max_tokens=10, stream=True), headers={"x-sim-output-tokens": "4"}
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    events = sse_events(await resp.read())
    prompt = await chat_prompt_tokens(client, {"model": MODEL, "messages": HI})
    message_id = events[0][1]["message"]["id"]
    assert message_id.startswith("chatcmpl-")
    assert events == [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": MODEL,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": prompt, "output_tokens": 0},
                },
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "content_block": {"type": "text", "text": ""},
                "index": 0,
            },
        ),
        *[
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "delta": {"type": "text_delta", "text": word},
                    "index": 0,
                },
            )
            for word in (" the", " cat", " sat")
        ],
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"input_tokens": prompt, "output_tokens": 4},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


async def test_stream_bytes_and_merged_deltas(client: TestClient) -> None:
    resp = await client.post(
        MESSAGES,
        json=body(max_tokens=5, stream=True),
        headers={"x-sim-chunk-tokens": "2", "X-Request-Id": "r1"},
    )
    raw = await resp.read()
    assert b"[DONE]" not in raw and b"ping" not in raw
    frames = raw.split(b"\n\n")
    assert frames[1] == (
        b"event: content_block_start\n"
        b'data: {"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}'
    )
    assert frames[2] == (
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" the cat"},'
        b'"index":0}'
    )
    events = sse_events(raw)
    deltas = [e[1]["delta"]["text"] for e in events if e[0] == "content_block_delta"]
    assert deltas == [" the cat", " sat on", " a"]
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 5
    assert events[0][1]["message"]["id"] == "chatcmpl-r1"


async def test_stream_failure_closes_the_block_then_errors(client: TestClient) -> None:
    resp = await client.post(
        MESSAGES, json=body(stream=True), headers={"x-sim-stream-error-after": "2"}
    )
    assert resp.status == 200
    names = [name for name, _ in sse_events(await resp.read())]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "error",
    ]
    resp = await client.post(
        MESSAGES, json=body(stream=True), headers={"x-sim-stream-error-after": "0"}
    )
    assert sse_events(await resp.read()) == [
        (
            "error",
            anthropic_error("api_error", "The server had an error while processing your request."),
        )
    ]
    # Not streamed: vLLM's router answers the engine's death with a 500.
    assert await post_json(client, MESSAGES, body(), headers={"x-sim-stream-error-after": "1"}) == (
        500,
        anthropic_error("api_error", "The server had an error while processing your request."),
    )


async def test_stream_engine_abort_has_no_stop_reason(client: TestClient) -> None:
    resp = await client.post(
        MESSAGES, json=body(stream=True), headers={"x-sim-finish-abort-after": "1"}
    )
    events = sse_events(await resp.read())
    assert [name for name, _ in events][-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[-2][1]["delta"] == {"stop_reason": None, "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 1


async def test_prompt_tokens_details_split_the_input(make_client: MakeClient) -> None:
    """With --enable-prompt-tokens-details vLLM's usage carries the cache split: input_tokens
    is what the prefix cache neither held nor took in."""
    client = await make_client(enable_prefix_caching=True, enable_prompt_tokens_details=True)
    long_hi = [{"role": "user", "content": "Tell me about the old town near the water. " * 4}]
    request = body(messages=long_hi)
    # Counted without the engine, so the cache stays cold.
    prompt = (await post_json(client, COUNT, {"model": MODEL, "messages": long_hi}))[1][
        "input_tokens"
    ]
    full_blocks = prompt // 16 * 16
    status, first = await post_json(client, MESSAGES, request)
    assert status == 200
    assert first["usage"] == {
        "input_tokens": prompt - full_blocks,
        "output_tokens": 8,
        "cache_creation_input_tokens": full_blocks,
        "cache_read_input_tokens": 0,
    }
    resp = await client.post(MESSAGES, json={**request, "stream": True})
    events = sse_events(await resp.read())
    hit = events[0][1]["message"]["usage"]["cache_read_input_tokens"]
    assert hit > 0
    start_usage = events[0][1]["message"]["usage"]
    assert start_usage["input_tokens"] + hit + start_usage["cache_creation_input_tokens"] == prompt
    assert events[-2][1]["usage"] == {**start_usage, "output_tokens": 8}


async def test_generation_holds_kv_like_a_chat(client: TestClient) -> None:
    status, data = await post_json(client, MESSAGES, body(max_tokens=6))
    assert status == 200
    snap = await stats(client)
    assert snap["kv_blocks_used"] == 0 and snap["running"] == 0
    served = snap["served"][-1]
    assert served["endpoint"] == "messages"
    assert served["prompt_tokens"] == data["usage"]["input_tokens"]
    assert served["completion_tokens_sent"] == 6


# --- count_tokens ----------------------------------------------------------------------------


async def test_count_tokens(make_client: MakeClient) -> None:
    client = await make_client(max_model_len=32)
    long = [{"role": "user", "content": "word " * 100}]
    # No length check: a prompt past max_model_len is still counted (as /tokenize does).
    status, data = await post_json(client, COUNT, {"model": MODEL, "messages": long})
    assert status == 200
    assert data["input_tokens"] > 32
    assert data == {
        "input_tokens": data["input_tokens"],
        "context_management": {"original_input_tokens": data["input_tokens"]},
    }
    tokenized = await post_json(client, "/tokenize", {"model": MODEL, "messages": long})
    assert tokenized[1]["count"] == data["input_tokens"]
    assert await post_json(client, COUNT, {"model": "other", "messages": HI}) == (
        404,
        anthropic_error(
            "not_found_error", f"The model `other` does not exist. Valid aliases: {MODEL}."
        ),
    )
    status, refused = await post_json(client, COUNT, {"model": MODEL})
    assert status == 400 and refused["error"]["param"] == "body.messages"
    # count_tokens takes no max_tokens and generates nothing.
    assert (await stats(client))["running"] == 0


# --- the official client ---------------------------------------------------------------------


async def test_anthropic_sdk(client: TestClient) -> None:
    anthropic = pytest.importorskip("anthropic")
    sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="x", max_retries=0)
    async with sdk:
        message = await sdk.messages.create(model=MODEL, max_tokens=5, messages=HI)
        assert message.content[0].text == " the cat sat on a"
        assert message.stop_reason == "max_tokens"
        assert message.usage.output_tokens == 5
        async with sdk.messages.stream(model=MODEL, max_tokens=5, messages=HI) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == " the cat sat on a"
        assert final.usage.input_tokens == message.usage.input_tokens
        assert final.usage.output_tokens == 5
        counted = await sdk.messages.count_tokens(model=MODEL, messages=HI)
        assert counted.input_tokens == message.usage.input_tokens
        with pytest.raises(anthropic.NotFoundError) as caught:
            await sdk.messages.create(model="other", max_tokens=5, messages=HI)
        assert caught.value.body["error"]["type"] == "not_found_error"
