"""POST /v1/responses (and GET/cancel of /v1/responses/{id}) as vLLM 0.34 serves them on the
chat-template path.

Where vLLM's own code can answer, it does: its request model and its conversion of input
items into chat messages (``vllm/entrypoints/openai/responses/{protocol,utils}.py``, typed
with the installed ``openai`` SDK) are loaded from the wheel in var/wheels with the rest of
vLLM they import stubbed, so a refusal is compared with what vLLM's model raises and a
request's prompt with the chat request built from vLLM's own conversion. Without the wheel
those tests skip; the rest pin the same behaviour by hand.
"""

from __future__ import annotations

import json
import sys
import types
import uuid
import zipfile
from typing import Annotated, Any, Literal
from unittest.mock import patch

import pytest
from aiohttp.test_utils import TestClient
from pydantic import BaseModel, BeforeValidator, Field, ValidationError

from testbed.engine_models import vllm_wheel
from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, MODEL
from vllm_sim.responses_protocol import body_errors, fastapi_validation_body

RESPONSES = "/v1/responses"
TEXT = " the cat sat on a"  # the simulator's first five output tokens
# Five tokens ending on EOS (the model stopped): four words, the EOS has no text.
STOPPED_TEXT = " the cat sat on"


# --- vLLM's own Responses modules, out of the wheel ------------------------------------------


class _Record:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


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


class _PerRequestMetrics(BaseModel):
    time_to_first_token_ms: float | None = None


def _load_vllm() -> types.SimpleNamespace | None:
    wheel_path = vllm_wheel() if _has_openai() else None  # fetched once; None offline
    if wheel_path is None:
        return None
    names = {
        "vllm.exceptions": "vllm/exceptions.py",
        "vllm.entrypoints.serve.engine.protocol": "vllm/entrypoints/serve/engine/protocol.py",
        "vllm.entrypoints.openai.responses.protocol": (
            "vllm/entrypoints/openai/responses/protocol.py"
        ),
        "vllm.entrypoints.openai.responses.utils": "vllm/entrypoints/openai/responses/utils.py",
    }
    with zipfile.ZipFile(wheel_path) as wheel:
        sources = {name: wheel.read(path).decode() for name, path in names.items()}
    modules: dict[str, types.ModuleType] = {}

    def module(name: str, **attributes: Any) -> types.ModuleType:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            modules.setdefault(".".join(parts[:i]), _Stubs(".".join(parts[:i])))
        modules[name].__dict__.update(attributes)
        return modules[name]

    for name in (
        "vllm.config",
        "vllm.renderers",
        "vllm.entrypoints.openai.chat_completion.protocol",
        "partial_json_parser.core.options",
    ):
        module(name)
    module("vllm.envs", VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS=[])
    module("vllm.logger", init_logger=lambda name: _Quiet())
    module("vllm.utils", random_uuid=lambda: uuid.uuid4().hex)
    module(
        "vllm.renderers.chat_utils",
        ChatCompletionMessageParam=dict[str, Any],
        ChatTemplateContentFormatOption=str,
        make_tool_call_id=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}",
    )
    module(
        "vllm.sampling_params",
        ThinkingTokenBudget=int | None,
        StructuredOutputsParams=dict[str, Any],
    )
    module(
        "vllm.entrypoints.generate.base.protocol",
        MMPayload=Literal["tensors", "none"],
        PerRequestMetrics=_PerRequestMetrics,
        StopParam=str | Annotated[list[str], Field(max_length=4)] | None,
        TopLogprobsParam=Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)],
        resolve_return_mm_kwargs_alias=lambda data: data,
    )
    module(
        "vllm.tool_parsers.utils",
        CUSTOM_TOOL_INPUT_KEY="input",
        flat_namespace_tool_name=lambda namespace, name: f"{namespace}__{name}",
    )
    modules["openai_harmony"] = types.SimpleNamespace(Message=dict)  # type: ignore[assignment]
    for name, mod in modules.items():
        parent, _, child = name.rpartition(".")
        if parent and parent in modules:
            setattr(modules[parent], child, mod)
    saved = dict(sys.modules)
    loaded: dict[str, types.ModuleType] = {}
    try:
        sys.modules.update(modules)
        for name, source in sources.items():
            mod = types.ModuleType(name)
            sys.modules[name] = mod
            exec(compile(source, names[name], "exec"), mod.__dict__)
            loaded[name.rsplit(".", 1)[-1]] = mod
            if name == "vllm.exceptions":
                generate = sys.modules["vllm.entrypoints.generate.base.protocol"]
                generate.validate_cache_salt = _cache_salt_check(mod)  # type: ignore[attr-defined]
    finally:
        for name in list(sys.modules):
            if name not in saved:
                del sys.modules[name]
        sys.modules.update(saved)
    # Lazy imports inside vLLM's functions (tool choice resolution) find the stubs again.
    return types.SimpleNamespace(stubs=modules, **loaded)


def _cache_salt_check(exceptions: types.ModuleType) -> Any:
    def check(salt: object) -> None:
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise exceptions.VLLMValidationError(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
                parameter="cache_salt",
            )

    return check


def _has_openai() -> bool:
    try:
        import openai  # noqa: F401
    except ImportError:
        return False
    return True


VLLM = _load_vllm()
needs_vllm = pytest.mark.skipif(VLLM is None, reason="vLLM 0.34's wheel (or openai) is missing")


def vllm_refusal(body: Any) -> tuple[int, dict[str, Any]]:
    """What vLLM answers a body its request model refuses with: FastAPI's 400 for pydantic's
    errors, or the VLLMValidationError handler's 400."""
    assert VLLM is not None
    try:
        with patch.dict(sys.modules, VLLM.stubs):
            VLLM.protocol.ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        return 400, fastapi_validation_body(body_errors(exc.errors(include_url=False)))
    except VLLM.exceptions.VLLMValidationError as exc:
        error = {"message": str(exc), "type": "BadRequestError", "param": exc.parameter}
        return 400, {"error": {**error, "code": 400}}
    raise AssertionError(f"vLLM accepts {body!r}")


def vllm_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for a Responses body (no stored history)."""
    assert VLLM is not None
    with patch.dict(sys.modules, VLLM.stubs):
        request = VLLM.protocol.ResponsesRequest.model_validate(body)
        messages = VLLM.utils.construct_input_messages(
            request_instructions=request.instructions, request_input=request.input
        )
    return json.loads(json.dumps(messages, default=lambda o: o.model_dump()))


# --- helpers ---------------------------------------------------------------------------------


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
    status, data = await post_json(client, CHAT, {"model": MODEL, **chat, "max_tokens": 1})
    assert status == 200, data
    return int(data["usage"]["prompt_tokens"])


async def input_tokens(client: TestClient, body: dict[str, Any]) -> int:
    status, data = await post_json(client, RESPONSES, {"max_output_tokens": 1, **body})
    assert status == 200, data
    return int(data["usage"]["input_tokens"])


def error(message: str, err_type: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": TOOL["parameters"],
    },
}
ITEMS: list[dict[str, Any]] = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Use the tool."}],
    },
    {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "It is sunny."}],
    },
    {"role": "user", "content": "And tomorrow?"},
]


# --- validation --------------------------------------------------------------------------------


async def test_missing_input_is_fastapis_400(client: TestClient) -> None:
    status, data = await post_json(client, RESPONSES, {"model": MODEL})
    assert status == 400
    assert data["error"]["param"] == "body.input"
    assert data["error"]["type"] == "Bad Request"
    assert data["error"]["message"].startswith("1 validation error:\n  {'type': 'missing'")


REFUSED_BODIES: dict[str, dict[str, Any]] = {
    "missing input": {"model": MODEL},
    "max_output_tokens not an int": {"input": "x", "max_output_tokens": "many"},
    "unknown truncation": {"input": "x", "truncation": "middle"},
    "presence_penalty over 2": {"input": "x", "presence_penalty": 3},
    "unknown include": {"input": "x", "include": ["everything"]},
    "required without tools": {"input": "x", "tool_choice": "required"},
    "named choice without tools": {
        "input": "x",
        "tool_choice": {"type": "function", "name": "get_weather"},
    },
    "named choice not among tools": {
        "input": "x",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "other"},
    },
    "background without store": {"input": "x", "background": True, "store": False},
    "prompt template": {"input": "x", "prompt": {"id": "pmpt_1"}},
    "empty cache_salt": {"input": "x", "cache_salt": ""},
    "grammar custom tool": {
        "input": "x",
        "tools": [{"type": "custom", "name": "c", "format": {"type": "grammar"}}],
    },
    "tool without a name": {"input": "x", "tools": [{"type": "function"}]},
    "reasoning effort unknown": {"input": "x", "reasoning": {"effort": "extreme"}},
}


@needs_vllm
@pytest.mark.parametrize("case", sorted(REFUSED_BODIES))
async def test_refusals_match_vllms_request_model(client: TestClient, case: str) -> None:
    body = REFUSED_BODIES[case]
    expected_status, expected = vllm_refusal(json.loads(json.dumps(body)))
    status, data = await post_json(client, RESPONSES, body)
    assert (status, data["error"]["type"], data["error"]["param"]) == (
        expected_status,
        expected["error"]["type"],
        expected["error"]["param"],
    )
    if case != "tool without a name":  # vLLM's Tool union has every SDK tool type
        assert data == expected


async def test_refusals_by_hand(client: TestClient) -> None:
    status, data = await post_json(client, RESPONSES, {"input": "x", "tool_choice": "required"})
    assert (status, data) == (
        400,
        error(
            "Tool choice 'required' must be specified with 'tools' parameter. "
            "(parameter=tool_choice)",
            "BadRequestError",
            "tool_choice",
            400,
        ),
    )
    # An item no input member takes: refused at body.input (vLLM lists more union members).
    status, data = await post_json(client, RESPONSES, {"input": [{"type": "bogus"}]})
    assert status == 400 and data["error"]["param"] == "body.input"
    assert data["error"]["type"] == "Bad Request"
    resp = await client.post(
        RESPONSES, data=b'{"input": "x"}', headers={"Content-Type": "text/plain"}
    )
    assert resp.status == 400
    assert "Only 'application/json' is allowed" in (await resp.json())["error"]["message"]


async def test_handler_refusals(make_client: MakeClient) -> None:
    client = await make_client(max_model_len=64)
    cases: list[tuple[dict[str, Any], int, dict[str, Any]]] = [
        (
            {"model": "other", "input": "x"},
            404,
            error(
                f"The model `other` does not exist. Valid aliases: {MODEL}.",
                "NotFoundError",
                "model",
                404,
            ),
        ),
        (
            {"input": [{"type": "item_reference", "id": "msg_1"}]},
            400,
            error(
                "Unsupported input item type: item_reference (parameter=input)",
                "BadRequestError",
                "input",
                400,
            ),
        ),
        (
            {
                "input": [
                    {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                    {"role": "user", "content": "hi"},
                ]
            },
            400,
            error(
                "Encrypted content is not supported. (parameter=input)",
                "BadRequestError",
                "input",
                400,
            ),
        ),
        (
            {"input": "x", "max_output_tokens": 65},
            400,
            error(
                "max_output_tokens=65 cannot be greater than max_model_len=64. Please request "
                "fewer output tokens. (parameter=max_output_tokens, value=65)",
                "BadRequestError",
                "max_output_tokens",
                400,
            ),
        ),
        (
            {"input": "x", "temperature": 3},
            400,
            error(
                "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)",
                "BadRequestError",
                "temperature",
                400,
            ),
        ),
        (
            {"input": "x", "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
            400,
            error(
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template.",
                "BadRequestError",
                None,
                400,
            ),
        ),
    ]
    for body, status, expected in cases:
        got_status, data = await post_json(client, RESPONSES, body)
        assert (got_status, data) == (status, expected), body
    # Over max_model_len: the tokenizer's check.
    status, data = await post_json(client, RESPONSES, {"input": "x" + " x" * 80})
    assert (status, data["error"]["param"]) == (400, "input_tokens")
    assert data["error"]["message"].startswith(
        "This model's maximum context length is 64 tokens. However, your prompt contains "
        "at least 65 input tokens"
    )
    # Exactly max_model_len: the handler's own ">=" check.
    prompt = await input_tokens(client, {"input": "x"})
    exact = await make_client(max_model_len=prompt)
    status, data = await post_json(exact, RESPONSES, {"input": "x"})
    assert (status, data) == (
        400,
        error(
            f"The engine prompt length {prompt} exceeds the max_model_len {prompt}. "
            "Please reduce prompt.",
            "invalid_request_error",
            "input",
            400,
        ),
    )


# --- the store (off, as vLLM's default) --------------------------------------------------------


async def test_store_defaults(client: TestClient) -> None:
    # store: true (the default) is accepted and silently dropped: nothing is retrievable.
    status, data = await post_json(
        client, RESPONSES, {"input": "hi", "store": True, "max_output_tokens": 2}
    )
    assert status == 200
    response_id = data["id"]
    assert response_id.startswith("resp_")
    resp = await client.get(f"{RESPONSES}/{response_id}")
    assert (resp.status, await resp.json()) == (
        404,
        error(
            f"Response with id '{response_id}' not found.",
            "invalid_request_error",
            "response_id",
            404,
        ),
    )
    resp = await client.post(f"{RESPONSES}/{response_id}/cancel")
    assert resp.status == 404
    status, data = await post_json(
        client, RESPONSES, {"input": "more", "previous_response_id": response_id}
    )
    assert (status, data) == (
        404,
        error(
            f"Response with id '{response_id}' not found.",
            "invalid_request_error",
            "response_id",
            404,
        ),
    )
    status, data = await post_json(client, RESPONSES, {"input": "hi", "background": True})
    assert status == 400
    assert data["error"]["param"] == "background"
    assert data["error"]["type"] == "invalid_request_error"
    assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in data["error"]["message"]


# --- conversion and prompt counts ------------------------------------------------------------


CONVERSIONS: dict[str, dict[str, Any]] = {
    "string": {"input": "Hello there, how are you?"},
    "instructions": {"instructions": "Be terse.", "input": "Hello there"},
    "items": {"instructions": "Be terse.", "input": ITEMS},
    "partial assistant": {
        "input": [
            {"role": "user", "content": "Count to three"},
            {
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [{"type": "output_text", "text": "One, two"}],
            },
        ]
    },
    "summary as reasoning": {
        "input": [
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Greet."}]},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ]
    },
}


@needs_vllm
@pytest.mark.parametrize("case", sorted(CONVERSIONS))
async def test_prompt_tokens_match_the_chat_vllm_builds(client: TestClient, case: str) -> None:
    body = CONVERSIONS[case]
    messages = vllm_messages(json.loads(json.dumps(body)))
    chat: dict[str, Any] = {"messages": messages}
    if case == "partial assistant":
        chat |= {"add_generation_prompt": False, "continue_final_message": True}
    assert await input_tokens(client, body) == await chat_prompt_tokens(client, chat)


async def test_prompt_tokens_match_the_chat_by_hand(client: TestClient) -> None:
    body = {"instructions": "Be terse.", "input": ITEMS, "tools": [TOOL]}
    chat = {
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "reasoning": "Use the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [CHAT_TOOL],
    }
    with_tools = await input_tokens(client, body)
    assert with_tools == await chat_prompt_tokens(client, chat)
    # Without tools the template has none to show (and tool_choice becomes "none").
    plain = await input_tokens(client, {"input": "Hello"})
    assert plain == await chat_prompt_tokens(
        client, {"messages": [{"role": "user", "content": "Hello"}]}
    )
    assert with_tools > plain
    # reasoning.effort reaches the template as the chat request's reasoning_effort.
    effort = await input_tokens(client, {"input": "Hello", "reasoning": {"effort": "low"}})
    assert effort == await chat_prompt_tokens(
        client, {"messages": [{"role": "user", "content": "Hello"}], "reasoning_effort": "low"}
    )


# --- the response object --------------------------------------------------------------------


async def test_response_shape_and_usage(client: TestClient) -> None:
    body = {
        "model": MODEL,
        "input": "Hello there, how are you?",
        "instructions": "Be terse.",
        "max_output_tokens": 50,
        "metadata": {"k": "v"},
        "text": {"format": {"type": "json_object"}},
        "tools": [TOOL],
        "tool_choice": "auto",
        "temperature": 0.5,
        "user": "u1",
    }
    status, data = await post_json(client, RESPONSES, body, headers={"x-sim-output-tokens": "5"})
    assert status == 200
    prompt = await chat_prompt_tokens(
        client,
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Hello there, how are you?"},
            ],
            "tools": [CHAT_TOOL],
        },
    )
    assert list(data) == [
        "id",
        "created_at",
        "incomplete_details",
        "instructions",
        "metadata",
        "model",
        "object",
        "output",
        "parallel_tool_calls",
        "temperature",
        "tool_choice",
        "tools",
        "top_p",
        "background",
        "max_output_tokens",
        "max_tool_calls",
        "previous_response_id",
        "prompt",
        "prompt_cache_options",
        "prompt_cache_key",
        "prompt_cache_retention",
        "reasoning",
        "safety_identifier",
        "service_tier",
        "status",
        "text",
        "top_logprobs",
        "truncation",
        "usage",
        "user",
        "presence_penalty",
        "frequency_penalty",
        "kv_transfer_params",
        "ec_transfer_params",
        "input_messages",
        "output_messages",
    ]
    assert data["id"].startswith("resp_") and data["object"] == "response"
    assert (data["status"], data["incomplete_details"]) == ("completed", None)
    assert (data["model"], data["instructions"], data["metadata"]) == (
        MODEL,
        "Be terse.",
        {"k": "v"},
    )
    assert (data["temperature"], data["top_p"], data["max_output_tokens"]) == (0.5, 1.0, 50)
    assert data["tool_choice"] == "auto"
    assert data["tools"] == [
        {
            "name": "get_weather",
            "parameters": TOOL["parameters"],
            "strict": None,
            "type": "function",
            "allowed_callers": None,
            "async": None,
            "defer_loading": None,
            "description": "Weather for a city",
            "output_schema": None,
        }
    ]
    assert data["text"] == {"format": {"type": "json_object"}, "verbosity": None}
    [item] = data["output"]
    assert item["id"].startswith("msg_")
    assert item == {
        "id": item["id"],
        "content": [
            {"annotations": [], "text": STOPPED_TEXT, "type": "output_text", "logprobs": None}
        ],
        "role": "assistant",
        "status": "completed",
        "type": "message",
        "phase": None,
    }
    assert data["usage"] == {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": 5,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + 5,
    }
    # No tools: tool_choice "auto" becomes "none"; the length cap is max_model_len - prompt.
    status, data = await post_json(client, RESPONSES, {"input": "Hi"})
    assert status == 200 and data["tool_choice"] == "none" and data["tools"] == []
    limit = (await (await client.get("/v1/models")).json())["data"][0]["max_model_len"]
    assert data["max_output_tokens"] == limit - data["usage"]["input_tokens"]


@needs_vllm
async def test_response_is_vllms_response_model_dumped(client: TestClient) -> None:
    """The body is byte for byte what vLLM's ResponsesResponse.from_request dumps for the same
    request, output and usage."""
    assert VLLM is not None
    body = {
        "model": MODEL,
        "request_id": "resp_fixed",
        "input": ITEMS,
        "instructions": "Be terse.",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"},
        "prompt_cache_key": "k",
        "prompt_cache_options": {"mode": "implicit", "prewarm": True},
        "prompt_cache_retention": "in-memory",
        "safety_identifier": "s",
        "max_output_tokens": 5,
        "top_p": 0.5,
        "presence_penalty": 1,
    }
    resp = await client.post(RESPONSES, json=body)
    raw = await resp.read()
    data = json.loads(raw)
    assert data["id"] == "resp_fixed" and data["status"] == "incomplete"
    with patch.dict(sys.modules, VLLM.stubs):
        request = VLLM.protocol.ResponsesRequest.model_validate(json.loads(json.dumps(body)))
        sampling = types.SimpleNamespace(
            temperature=1.0,
            top_p=0.5,
            max_tokens=5,
            presence_penalty=1.0,
            frequency_penalty=0.0,
            logprobs=None,
        )
        expected = VLLM.protocol.ResponsesResponse.from_request(
            request,
            sampling,
            model_name=MODEL,
            created_time=data["created_at"],
            output=data["output"],
            status="incomplete",
            usage=VLLM.protocol.ResponseUsage.model_validate(data["usage"]),
        ).model_dump(mode="json", by_alias=True)
    assert data == expected
    dumped = json.dumps(expected, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert raw == dumped.encode()


@needs_vllm
async def test_stream_events_are_vllms_event_models_dumped(client: TestClient) -> None:
    """Every frame's data is what pydantic's model_dump_json writes for the event models vLLM
    yields."""
    assert VLLM is not None
    from openai.types.responses import ResponseTextDeltaEvent, ResponseTextDoneEvent
    from pydantic import TypeAdapter

    resp = await client.post(
        RESPONSES,
        json={"input": "Hi", "stream": True, "max_output_tokens": 4},
        headers={"x-sim-chunk-tokens": "3"},
    )
    raw = await resp.read()
    with patch.dict(sys.modules, VLLM.stubs):
        # vLLM's alias leaves out the text events its processor yields (openai's own types).
        events = VLLM.protocol.StreamingResponsesResponse
        adapter: Any = TypeAdapter(events | ResponseTextDeltaEvent | ResponseTextDoneEvent)
        for frame in raw[:-2].split(b"\n\n"):
            data = frame.split(b"\n")[1][len(b"data: ") :]
            event = adapter.validate_json(data)
            assert event.model_dump_json(indent=None, by_alias=True).encode() == data


async def test_incomplete_when_max_output_tokens_cuts(client: TestClient) -> None:
    status, data = await post_json(client, RESPONSES, {"input": "Hi", "max_output_tokens": 5})
    assert status == 200
    assert data["status"] == "incomplete"
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["output"][0]["status"] == "incomplete"
    assert data["output"][0]["content"][0]["text"] == TEXT
    assert data["usage"]["output_tokens"] == 5


async def test_cached_tokens_with_prefix_caching(make_client: MakeClient) -> None:
    client = await make_client(enable_prefix_caching=True)
    body = {"input": "word " * 60, "max_output_tokens": 2}
    status, first = await post_json(client, RESPONSES, body)
    assert status == 200
    prompt = first["usage"]["input_tokens"]
    details = first["usage"]["input_tokens_details"]
    assert details["cached_tokens"] == 0
    assert details["cache_write_tokens"] == prompt // 16 * 16
    status, second = await post_json(client, RESPONSES, body)
    assert second["usage"]["input_tokens"] == prompt
    # The hit stops short of the prompt's last token (it is always computed).
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16


# --- the stream -----------------------------------------------------------------------------


async def test_stream_events_in_order(client: TestClient) -> None:
    resp = await client.post(
        RESPONSES,
        json={"input": "Hi", "stream": True, "max_output_tokens": 50},
        headers={"x-sim-output-tokens": "5", "x-sim-chunk-tokens": "2"},
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    raw = await resp.read()
    events = sse_events(raw)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    created, progress = events[0][1]["response"], events[1][1]["response"]
    assert created == progress
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    added = events[2][1]
    item_id = added["item"]["id"]
    assert added == {
        "item": {
            "id": item_id,
            "content": [],
            "role": "assistant",
            "status": "in_progress",
            "type": "message",
            "phase": None,
        },
        "output_index": 0,
        "sequence_number": 2,
        "type": "response.output_item.added",
    }
    assert events[3][1] == {
        "content_index": 0,
        "item_id": item_id,
        "output_index": 0,
        "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []},
        "sequence_number": 3,
        "type": "response.content_part.added",
    }
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    # The third engine output is the EOS alone: an empty delta, which vLLM skips.
    assert deltas == [" the cat", " sat on"]
    assert events[4][1] == {
        "content_index": 0,
        "delta": " the cat",
        "item_id": item_id,
        "logprobs": [],
        "output_index": 0,
        "sequence_number": 4,
        "type": "response.output_text.delta",
    }
    part = {"annotations": [], "text": STOPPED_TEXT, "type": "output_text", "logprobs": None}
    assert events[6][1] == {
        "content_index": 0,
        "item_id": item_id,
        "logprobs": [],
        "output_index": 0,
        "sequence_number": 6,
        "text": STOPPED_TEXT,
        "type": "response.output_text.done",
    }
    assert events[7][1]["part"] == part
    done_item = events[8][1]["item"]
    assert done_item == {**added["item"], "content": [part], "status": "completed"}
    final = events[9][1]["response"]
    assert final["id"] == created["id"] and final["status"] == "completed"
    assert final["output"] == [done_item]
    assert final["usage"]["output_tokens"] == 5
    assert final["usage"]["total_tokens"] == final["usage"]["input_tokens"] + 5
    # Compact JSON, as pydantic's model_dump_json writes it.
    assert b'data: {"response":{"id":"resp_' in raw and b'"sequence_number":0,' in raw


async def test_stream_incomplete_on_max_output_tokens(client: TestClient) -> None:
    resp = await client.post(
        RESPONSES, json={"input": "Hi", "stream": True, "max_output_tokens": 3}
    )
    events = sse_events(await resp.read())
    assert events[-1][0] == "response.incomplete"
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert events[-2][1]["item"]["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 3


# --- the official SDK -----------------------------------------------------------------------


async def test_openai_sdk_responses(client: TestClient) -> None:
    openai = pytest.importorskip("openai")
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    async with sdk:
        response = await sdk.responses.create(model=MODEL, input="Hello", max_output_tokens=5)
        assert response.output_text == TEXT
        assert response.status == "incomplete"
        assert response.usage is not None and response.usage.output_tokens == 5
        stream = await sdk.responses.create(
            model=MODEL, input="Hello", max_output_tokens=5, stream=True
        )
        kinds, text, final = [], "", None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert text == TEXT
        assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
        assert final is not None and final.usage is not None
        assert final.usage.input_tokens == response.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(response.id)
        with pytest.raises(openai.BadRequestError):
            await sdk.responses.create(model=MODEL, input="Hi", tool_choice="required")
