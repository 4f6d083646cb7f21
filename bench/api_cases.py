"""The interleaved benchmark's requests in the Anthropic Messages and OpenAI Responses shapes.

bench/interleaved.py measures its `1k` and `conversation` cases on chat completions; the
cases `1k-messages`, `conversation-messages`, `1k-responses` and `conversation-responses`
send the same prompt sizes and the same history growth on `POST /v1/messages` and
`POST /v1/responses`, in each API's own request shape, so kvgate's added cost per API can be
set beside chat's from the same run. `conversation-chat-tools` sends the agent conversation of
the two others on chat completions (assistant `tool_calls`, `tool` messages, `tools`): the
chat reference for the same request shape, which tells the cost of an API from the cost of a
history with tool calls.

| API       | path                   | 1k                        | conversation turn k            |
|-----------|------------------------|---------------------------|--------------------------------|
| chat      | /v1/chat/completions   | one user message          | system + (user, assistant)     |
|           |                        |                           | x (k-1) + user                 |
| messages  | /v1/messages           | one user message          | `system` + user, then per past |
|           |                        | (string content)          | exchange: assistant [text,     |
|           |                        |                           | tool_use], user [tool_result,  |
|           |                        |                           | text]; `tools` declared        |
| responses | /v1/responses          | `input` a string          | `instructions` + input items:  |
|           |                        |                           | user message, then per past    |
|           |                        |                           | exchange: assistant message,   |
|           |                        |                           | function_call,                 |
|           |                        |                           | function_call_output, user     |
|           |                        |                           | message; `tools` declared      |

In the conversations the chat case's ~1,500-token assistant answer is, on the two other APIs,
an agent's step: ~300 tokens of assistant text, a tool call whose arguments are ~200 tokens
and the tool's ~1,000-token output (a file read, a command's output), so each turn still adds
~2,000 tokens. The two tools' definitions (sent with every turn) and the template's framing
of a tool call and its result take tokens the chat case does not have: the system prompt and
the tool output are shortened by those (measured on the demo model's template), so every
turn's prompt is within ~0.5 % of the chat turn's. The output cap is 16 (`max_tokens` on
Messages, `max_output_tokens` on Responses). Messages are authenticated with `x-api-key`
(what Anthropic's SDKs send) and carry `anthropic-version`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

APIS = ("chat", "messages", "responses", "embeddings")
# "chat-tools": the agent conversation on chat completions.
WIRE_API = {
    "chat": "chat",
    "chat-tools": "chat",
    "messages": "messages",
    "responses": "responses",
    "embeddings": "embeddings",
}
PATHS = {
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
}
# `1k-embeddings`: the 1k text as one embedding input, on the simulator's embedding model
# (WordLlama, a Llama-2 vocabulary: the same text is ~1.2k of its tokens).
EMBEDDING_MODEL = "wordllama-l2-supercat"
ANTHROPIC_VERSION = "2023-06-01"

# The chat conversation's ~1,500-token assistant answer, split into an agent's step.
STEP_TEXT_TOKENS = 300
STEP_ARGS_TOKENS = 200
# What the demo model's template adds over the chat case (measured: turn 1 +262 tokens on
# Messages, +271 on Responses; each step +39): taken off the system prompt and the tool output.
TOOL_DEFINITION_TOKENS = 265
STEP_FRAMING_TOKENS = 40
STEP_OUTPUT_TOKENS = 1000 - STEP_FRAMING_TOKENS

# Two function tools, declared in every conversation request (as an agent sends its tools
# with every turn).
TOOLS: list[dict[str, Any]] = [
    {
        "name": "read_file",
        "description": "Read a file of the repository and return its text.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Path from the repository root."},
                "note": {"type": "string", "description": "Why the file is read."},
            },
            "required": ["path"],
        },
    },
    {
        "name": "run",
        "description": "Run a shell command in the repository and return its output.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command line."},
                "note": {"type": "string", "description": "Why it is run."},
            },
            "required": ["command"],
        },
    },
]


def api_headers(api: str, api_key: str) -> dict[str, str]:
    """The request headers of one API with the tenant's key."""
    if api == "messages":
        return {
            "content-type": "application/json",
            "x-api-key": api_key,
            "anthropic-version": ANTHROPIC_VERSION,
        }
    return {"content-type": "application/json", "authorization": f"Bearer {api_key}"}


def prompt_tokens_of(api: str, answer: dict[str, Any]) -> int:
    """The engine's prompt size from a JSON answer's usage."""
    usage = answer["usage"]
    return int(usage["prompt_tokens"] if api in ("chat", "embeddings") else usage["input_tokens"])


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- 1k


def single_body(api: str, model: str, content: str, max_tokens: int) -> bytes:
    """One user message (non-streamed), in the API's shape."""
    if api == "messages":
        messages = [{"role": "user", "content": content}]
        return _dump({"model": model, "max_tokens": max_tokens, "messages": messages})
    if api == "responses":
        return _dump({"model": model, "input": content, "max_output_tokens": max_tokens})
    if api == "embeddings":
        # Nothing is generated: no cap; the embedding model, not the chat one.
        return _dump({"model": EMBEDDING_MODEL, "input": content})
    raise ValueError(f"not an API of this module: {api!r}")


# --------------------------------------------------------------------------- conversations


class AgentConversation:
    """One conversation's text, drawn once, and its turns in an API's shape.

    `words(rng, n)` draws n single-token words. Turn k (1-based) holds the system prompt, k-1
    exchanges (user message, assistant text, tool call, tool output) and the k-th user message.
    """

    def __init__(
        self,
        rng: random.Random,
        words: Callable[[random.Random, int], str],
        *,
        system: str,
        turns: int,
        user_tokens: int,
    ) -> None:
        self.system = system
        self.users = [words(rng, user_tokens) for _ in range(turns)]
        self.steps: list[tuple[str, str, dict[str, str], str]] = []
        for k in range(turns - 1):
            tool = TOOLS[k % len(TOOLS)]["name"]
            first = "path" if tool == "read_file" else "command"
            arguments = {first: f"src/module_{k}.py", "note": words(rng, STEP_ARGS_TOKENS)}
            self.steps.append(
                (
                    words(rng, STEP_TEXT_TOKENS),
                    tool,
                    arguments,
                    words(rng, STEP_OUTPUT_TOKENS),
                )
            )

    def messages_body(self, model: str, turn: int, max_tokens: int, tag: str) -> bytes:
        """Anthropic Messages: system, then user / assistant [text, tool_use] / user
        [tool_result, text] ..."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": self.users[0]}]
        for k in range(turn - 1):
            text, tool, arguments, output = self.steps[k]
            call_id = f"toolu_{tag}_{k}"
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": text},
                        {"type": "tool_use", "id": call_id, "name": tool, "input": arguments},
                    ],
                }
            )
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call_id, "content": output},
                        {"type": "text", "text": self.users[k + 1]},
                    ],
                }
            )
        tools = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            for t in TOOLS
        ]
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "system": self.system,
            "tools": tools,
            "messages": messages,
        }
        return _dump(body)

    def responses_body(self, model: str, turn: int, max_tokens: int, tag: str) -> bytes:
        """OpenAI Responses: instructions, then input items user message / assistant message /
        function_call / function_call_output / user message ..."""
        items: list[dict[str, Any]] = [_user_item(self.users[0])]
        for k in range(turn - 1):
            text, tool, arguments, output = self.steps[k]
            call_id = f"call_{tag}_{k}"
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                }
            )
            items.append(
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": tool,
                    "arguments": json.dumps(arguments),
                }
            )
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})
            items.append(_user_item(self.users[k + 1]))
        tools = [{"type": "function", "strict": False, **t} for t in TOOLS]
        body = {
            "model": model,
            "instructions": self.system,
            "input": items,
            "tools": tools,
            "max_output_tokens": max_tokens,
        }
        return _dump(body)

    def chat_body(self, model: str, turn: int, max_tokens: int, tag: str) -> bytes:
        """Chat completions: system, user, then per past exchange: assistant (text +
        tool_calls) / tool / user ..."""
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.users[0]},
        ]
        for k in range(turn - 1):
            text, tool, arguments, output = self.steps[k]
            call_id = f"call_{tag}_{k}"
            call = {"name": tool, "arguments": json.dumps(arguments)}
            messages.append(
                {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [{"id": call_id, "type": "function", "function": call}],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            messages.append({"role": "user", "content": self.users[k + 1]})
        tools = [{"type": "function", "function": t} for t in TOOLS]
        body = {"model": model, "messages": messages, "tools": tools, "max_tokens": max_tokens}
        return _dump(body)

    def body(self, api: str, model: str, turn: int, max_tokens: int, tag: str) -> bytes:
        if api == "chat-tools":
            return self.chat_body(model, turn, max_tokens, tag)
        if api == "messages":
            return self.messages_body(model, turn, max_tokens, tag)
        if api == "responses":
            return self.responses_body(model, turn, max_tokens, tag)
        raise ValueError(f"not an API of this module: {api!r}")


def _user_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
