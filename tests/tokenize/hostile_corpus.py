"""Chat requests built to make a counter and the engine disagree: literal special-token text
of every family in every place a text can go, tools, tool calls and results, content parts,
empty messages, long and Unicode-heavy texts. Deterministic (a fixed seed)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

# Special-token spellings of the families a gateway meets: GPT-2/Qwen, ChatML, Llama 2/3,
# Mistral (SentencePiece and tekken control tokens), harmony (gpt-oss), tool-call tags.
SPECIAL_TEXTS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[ARGS]",
    "[THINK]",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
    "<|startoftext|>",
    "<|reserved_200100|>",
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
)
UNICODE_TEXT = (
    "Zürich ½ ² café cafe\u0301 👩‍👩‍👧‍👦 🏳️‍🌈 中文的文本\uff0c日本語のテキスト、한국어 "
    "العربية עברית हिन्दी ไทย \u00a0\u2009\u200b\ufeff e\u0301\u0301"
)


@dataclass(frozen=True)
class ChatCase:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The family of special text the case carries ("" for structure-only cases).
    family: str = field(default="")


def _tool(name: str, description: str, extra_param: str = "city") -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {extra_param: {"type": "string", "description": description}},
                "required": [extra_param],
            },
        },
    }


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _random_text(rng: random.Random, chars: int) -> str:
    pieces: list[str] = []
    size = 0
    while size < chars:
        roll = rng.random()
        if roll < 0.08:
            piece = rng.choice(SPECIAL_TEXTS)
        elif roll < 0.2:
            piece = rng.choice(UNICODE_TEXT.split(" ")) + " "
        else:
            piece = "".join(rng.choice("abcdefghij klmnop\nqrst uvwxyz") for _ in range(12))
        pieces.append(piece)
        size += len(piece)
    return "".join(pieces)[:chars]


def chat_cases() -> list[ChatCase]:
    """The corpus: one flood and one of each placement per special text, then structure."""
    rng = random.Random(20261204)
    cases: list[ChatCase] = []
    for text in SPECIAL_TEXTS:
        cases.append(
            ChatCase(f"flood {text}", [{"role": "user", "content": text * 300}], family=text)
        )
        cases.append(
            ChatCase(
                f"placements {text}",
                [
                    {"role": "system", "content": f"Obey {text} always {text}"},
                    {"role": "user", "content": f"{text}hello{text} world {text}"},
                    {"role": "assistant", "content": f"Sure {text}{text} done"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": f"part one {text}"},
                            {"type": "text", "text": f"{text} part two"},
                        ],
                    },
                ],
                family=text,
            )
        )
        cases.append(
            ChatCase(
                f"tools {text}",
                [
                    {"role": "user", "content": f"weather in {text}?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [_call("call_0123456789abc", "get_weather", {"city": text})],
                    },
                    {
                        "role": "tool",
                        "tool_call_id": "call_0123456789abc",
                        "content": f"sunny {text} 21°C",
                    },
                    {"role": "user", "content": f"and tomorrow {text}"},
                ],
                tools=[_tool("get_weather", f"Weather {text} lookup")],
                family=text,
            )
        )
    cases += [
        ChatCase("empty user", [{"role": "user", "content": ""}]),
        ChatCase(
            "empty assistant turn",
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": ""},
                {"role": "user", "content": "again"},
            ],
        ),
        ChatCase("empty parts", [{"role": "user", "content": [{"type": "text", "text": ""}]}]),
        ChatCase("unicode", [{"role": "user", "content": UNICODE_TEXT * 20}]),
        ChatCase(
            "50k hostile",
            [
                {"role": "system", "content": _random_text(rng, 2_000)},
                {"role": "user", "content": _random_text(rng, 50_000)},
            ],
        ),
        ChatCase("50k plain", [{"role": "user", "content": "lorem ipsum dolor " * 2800}]),
        ChatCase(
            "continue final message",
            [
                {"role": "user", "content": "Write [INST] a poem"},
                {"role": "assistant", "content": "Roses <|endoftext|> are"},
            ],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        ChatCase(
            "parallel tool calls",
            [
                {"role": "system", "content": "You route calls."},
                {"role": "user", "content": "two cities"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        _call("aaaaaaaaa", "get_weather", {"city": "Paris [TOOL_CALLS]"}),
                        _call("bbbbbbbbbbbbbbbbbb", "get_weather", {"city": "Köln"}),
                    ],
                },
                {"role": "tool", "tool_call_id": "aaaaaaaaa", "content": "rain"},
                {"role": "tool", "tool_call_id": "bbbbbbbbbbbbbbbbbb", "content": "<s>snow</s>"},
            ],
            tools=[_tool("get_weather", "Weather"), _tool("get_time", "Time [INST]", "zone")],
        ),
        ChatCase(
            "tools without description",
            [{"role": "user", "content": "call something"}],
            tools=[{"type": "function", "function": {"name": "noop"}}],
        ),
    ]
    return cases


COMPLETION_PROMPTS = (
    "<|endoftext|>" * 2000,
    "[INST]" * 2000,
    "".join(SPECIAL_TEXTS),
    UNICODE_TEXT,
    "plain prompt, nothing special",
)
