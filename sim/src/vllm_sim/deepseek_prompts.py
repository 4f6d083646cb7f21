# ruff: noqa: RUF001, RUF002 (DeepSeek's control tokens are spelled with fullwidth bars)
"""DeepSeek V3.2 / V4 chats as vLLM's ``deepseek_v32`` / ``deepseek_v4`` tokenizer modes build
them: DeepSeek's Python prompt encoders instead of a chat template, then the prompt string
tokenized by the Hugging Face tokenizer (``add_special_tokens`` as requested, added tokens
matched anywhere, so a ``<｜User｜>`` typed by a user is that token).

vLLM picks these modes under ``--tokenizer-mode auto`` from the resolved architecture:
``DeepseekV32ForCausalLM`` -> deepseek_v32; ``DeepseekV4ForCausalLM`` and
``DeepseekV4ForConditionalGeneration`` -> deepseek_v4.

Independent of kvgate: written from vLLM's behaviour, sharing no code with its counter.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_sim.chat_flags import DEFAULT_FLAGS, chat_kwargs
from vllm_sim.tokenization import PromptError, SimTokenizer, preprocess_messages

ARCHITECTURE_MODES = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "DeepseekV4ForConditionalGeneration": "deepseek_v4",
}

SENTENCE_START = "<｜begin▁of▁sentence｜>"
SENTENCE_END = "<｜end▁of▁sentence｜>"
USER_TAG = "<｜User｜>"
ASSISTANT_TAG = "<｜Assistant｜>"
REMINDER_TAG = "<｜latest_reminder｜>"
THINK = "<think>"
UNTHINK = "</think>"
MARKUP = "｜DSML｜"
IMAGE = "<｜deepseek_image｜>"
TASKS = {
    name: f"<｜{name}｜>"
    for name in ("action", "query", "authority", "domain", "title", "read_url")
}

V32_TOOLS = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the user:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<｜DSML｜function_calls>
...
</｜DSML｜function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
SCHEMAS
</functions>
"""  # noqa: E501

V4_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

SCHEMAS

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501

EFFORT_TEXT = {
    "low": "",
    "high": "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n",
    "max": "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every "
    "causal chain to its root, and resolve the underlying cause rather than any surface "
    "symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n",
}


def architecture_mode(model_dir: Path) -> str | None:
    """The DeepSeek mode vLLM's auto takes for this config's first listed architecture."""
    try:
        with open(model_dir / "config.json", encoding="utf-8") as fh:
            listed = json.load(fh).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return ARCHITECTURE_MODES.get(listed[0]) if listed and isinstance(listed[0], str) else None


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except Exception:
        return json.dumps(value, ensure_ascii=True)


def _as_text(value: Any) -> str:
    return "{}".format(value)  # noqa: UP032 - str.format is what the encoders write with


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.34 coerces tool-call arguments that are not a JSON object (malformed JSON,
    a list, a number) to {} rather than failing the turn."""
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not isinstance(calls, list):
        return message
    message = copy.deepcopy(message)
    for call in message["tool_calls"]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not fn.get("arguments"):
            continue
        value = fn["arguments"]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                value = {}
        fn["arguments"] = value if isinstance(value, dict) else {}
    return message


def _vllm_conversation(messages: Sequence[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """vLLM's parsed conversation: the simulator's preprocessing plus the keys vLLM keeps
    that the template path has no use for (reasoning, task, joined tool texts)."""
    messages = [_with_object_arguments(m) for m in messages]
    conversation = preprocess_messages(messages, fmt)  # type: ignore[arg-type]
    for source, out in zip(messages, conversation, strict=True):
        role = out["role"]
        if role == "assistant":
            reasoning = source.get("reasoning")
            if reasoning is None:
                reasoning = source.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = reasoning
            if out.get("tool_calls") == []:
                del out["tool_calls"]
        if role == "tool" and isinstance(out["content"], list):
            out["content"] = "\n".join(part["text"] for part in out["content"])
        if isinstance(source.get("task"), str):
            out["task"] = source["task"]
        if role == "developer":
            out["tools"] = source.get("tools")
    return conversation


def _invocations(calls: list[Any], block_name: str) -> str:
    rendered = []
    for call in calls:
        fn = call["function"]
        args = fn["arguments"]
        lines = []
        for key, value in args.items():
            is_str = isinstance(value, str)
            shown = value if is_str else _dumps(value)
            flag = "true" if is_str else "false"
            lines.append(
                f'<{MARKUP}parameter name="{key}" string="{flag}">{shown}</{MARKUP}parameter>'
            )
        body = "\n".join(lines)
        rendered.append(
            f'<{MARKUP}invoke name="{_as_text(fn["name"])}">\n{body}\n</{MARKUP}invoke>'
        )
    inner = "\n".join(rendered)
    return f"\n\n<{MARKUP}{block_name}>\n{inner}\n</{MARKUP}{block_name}>"


def _schema_block(template: str, tools: list[Any]) -> str:
    return template.replace("SCHEMAS", "\n".join(_dumps(t["function"]) for t in tools))


def _final_user_position(msgs: list[dict[str, Any]]) -> int:
    for pos in range(len(msgs) - 1, -1, -1):
        if msgs[pos].get("role") in ("user", "developer"):
            return pos
    return -1


def _forget_old_thoughts(msgs: list[dict[str, Any]], survivors: set[str]) -> list[dict[str, Any]]:
    cutoff = _final_user_position(msgs)
    kept: list[dict[str, Any]] = []
    for pos, msg in enumerate(msgs):
        if msg.get("role") in survivors or pos >= cutoff:
            kept.append(msg)
        elif msg.get("role") == "assistant":
            stripped = dict(msg)
            stripped.pop("reasoning", None)
            kept.append(stripped)
    return kept


class _V32Prompt:
    def __init__(self, msgs: list[dict[str, Any]], thinking: bool) -> None:
        if thinking and msgs[-1].get("role") == "user":
            shorter = _forget_old_thoughts(msgs, {"user", "system", "tool"})
            if len(shorter) != len(msgs):
                # vLLM renders indices of the request's length over the shortened list.
                raise PromptError(f"Index {len(shorter)} out of range for messages list")
            msgs = shorter
        self.msgs = msgs
        self.thinking = thinking
        self.cutoff = _final_user_position(msgs)

    def build(self) -> str:
        return SENTENCE_START + "".join(self.turn(pos) for pos in range(len(self.msgs)))

    def close(self, opens_thought: bool) -> str:
        return THINK if self.thinking and opens_thought else UNTHINK

    def turn(self, pos: int) -> str:
        msg = self.msgs[pos]
        role = msg.get("role")
        content = msg.get("content")
        tools = msg.get("tools")
        if role == "system":
            text = content or ""
            return text + "\n\n" + _schema_block(V32_TOOLS, tools) if tools else text
        if role == "developer":
            if not content:
                raise PromptError("developer message without content")
            tools_text = "\n\n" + _schema_block(V32_TOOLS, tools) if tools else ""
            return (
                USER_TAG
                + tools_text
                + "\n\n# The user's message is: "
                + _as_text(content)
                + ASSISTANT_TAG
                + self.close(pos == self.cutoff)
            )
        if role == "user":
            return USER_TAG + _as_text(content) + ASSISTANT_TAG + self.close(pos == self.cutoff)
        if role == "tool":
            back = pos - 1
            owner = self.msgs[back]
            while back >= 0 and owner.get("role") == "tool":
                back -= 1
                owner = self.msgs[back]
            if pos != 0 and not (back >= 0 and owner.get("role") == "assistant"):
                raise PromptError("tool output without a preceding assistant")
            nth = pos - back
            calls = owner.get("tool_calls")
            if not calls or len(calls) < nth:
                raise PromptError("No tool calls but found tool output")
            piece = "\n\n<function_results>" if nth == 1 else ""
            piece += "\n<result>" + _as_text(content) + "</result>"
            if nth == len(calls):
                piece += "\n</function_results>\n\n" + self.close(pos >= self.cutoff)
            return piece
        if role == "assistant":
            calls = msg.get("tool_calls")
            calls_text = _invocations(calls, "function_calls") if calls else ""
            thought = ""
            if self.thinking and pos > self.cutoff:
                if not (msg.get("reasoning") or calls):
                    raise PromptError("assistant turn after the last user needs reasoning")
                thought = _as_text(msg.get("reasoning") or "") + UNTHINK
            return thought + (content or "") + calls_text + SENTENCE_END
        raise PromptError(f"Invalid role: {role}")


def _flatten_parts(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    out = []
    for part in content:
        if not isinstance(part, dict):
            out.append(str(part))
        elif part.get("type") in ("image", "image_url"):
            out.append(IMAGE)
        elif part.get("type") == "text":
            out.append(part.get("text", ""))
        else:
            raise PromptError(f"Unsupported content block type: {part.get('type')!r}")
    return "\n\n".join(out)


class _V4Prompt:
    def __init__(
        self, msgs: list[dict[str, Any]], thinking: bool, drop: bool, effort: str | None
    ) -> None:
        msgs = self._fold_tool_results(msgs)
        self._reorder_results(msgs)
        if any(m.get("tools") for m in msgs):
            drop = False
        if thinking and drop:
            survivors = {"user", "system", "tool", "latest_reminder", "direct_search_results"}
            msgs = _forget_old_thoughts(msgs, survivors)
        self.msgs, self.thinking, self.drop = msgs, thinking, drop
        self.effort = effort or "low"
        if self.effort not in EFFORT_TEXT:
            raise PromptError(f"Invalid reasoning effort: {self.effort}")
        self.cutoff = _final_user_position(msgs)

    @staticmethod
    def _fold_tool_results(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        folded: list[dict[str, Any]] = []
        for msg in map(copy.deepcopy, msgs):
            role = msg.get("role")
            tail = folded[-1] if folded else {}
            tail_open = tail.get("role") == "user" and "content_blocks" in tail
            if role == "tool":
                block = {
                    "type": "tool_result",
                    "tool_use_id": msg.get("tool_call_id", ""),
                    "content": msg.get("content", ""),
                }
                if tail_open:
                    tail["content_blocks"].append(block)
                else:
                    folded.append({"role": "user", "content_blocks": [block]})
            elif role == "user":
                text = _flatten_parts(msg.get("content", ""))
                if tail_open and tail.get("task") is None:
                    tail["content_blocks"].append({"type": "text", "text": text})
                else:
                    fresh = {
                        "role": "user",
                        "content": text,
                        "content_blocks": [{"type": "text", "text": text}],
                    }
                    if "task" in msg:
                        fresh["task"] = msg["task"]
                    folded.append(fresh)
            else:
                folded.append(msg)
        return folded

    @staticmethod
    def _reorder_results(msgs: list[dict[str, Any]]) -> None:
        order: dict[str, int] = {}
        for msg in msgs:
            if msg.get("role") == "assistant" and msg.get("tool_calls"):
                order = {}
                for n, call in enumerate(msg["tool_calls"]):
                    key = call.get("id") or call.get("function", {}).get("id", "")
                    if key:
                        order[key] = n
            elif msg.get("role") == "user" and msg.get("content_blocks"):
                results = [b for b in msg["content_blocks"] if b.get("type") == "tool_result"]
                if len(results) > 1 and order:
                    queue = sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0))
                    replaced = []
                    for block in msg["content_blocks"]:
                        replaced.append(
                            queue.pop(0) if block.get("type") == "tool_result" else block
                        )
                    msg["content_blocks"] = replaced

    def build(self) -> str:
        head = SENTENCE_START
        if self.msgs and self.thinking:
            head += EFFORT_TEXT[self.effort]
        return head + "".join(self.turn(pos) for pos in range(len(self.msgs)))

    def turn(self, pos: int) -> str:
        msg = self.msgs[pos]
        role = msg.get("role")
        content = _flatten_parts(msg.get("content"))
        tools = msg.get("tools")
        tools_text = "\n\n" + _schema_block(V4_TOOLS, tools) if tools else ""
        if role == "system":
            text = _as_text(content or "") + tools_text
        elif role == "developer":
            if not content:
                raise PromptError("developer message without content")
            text = USER_TAG + content + tools_text
        elif role == "user":
            blocks = msg.get("content_blocks")
            if blocks:
                pieces = []
                for block in blocks:
                    kind = block.get("type")
                    if kind == "text":
                        pieces.append(block.get("text", ""))
                    elif kind in ("image", "image_url"):
                        pieces.append(IMAGE)
                    elif kind == "tool_result":
                        result = block.get("content", "")
                        if isinstance(result, list):
                            result = "\n\n".join(
                                b.get("text", "")
                                if b.get("type") == "text"
                                else f"[Unsupported {b.get('type')}]"
                                for b in result
                            )
                        pieces.append("<tool_result>" + _as_text(result) + "</tool_result>")
                    else:
                        pieces.append(f"[Unsupported {kind}]")
                text = USER_TAG + "\n\n".join(pieces)
            else:
                text = USER_TAG + (content or "")
        elif role == "latest_reminder":
            text = REMINDER_TAG + _as_text(content)
        elif role == "assistant":
            calls = msg.get("tool_calls")
            calls_text = _invocations(calls, "tool_calls") if calls else ""
            thought = ""
            after_task = pos >= 1 and self.msgs[pos - 1].get("task") is not None
            if self.thinking and not after_task and (not self.drop or pos > self.cutoff):
                thought = _as_text(msg.get("reasoning") or "") + UNTHINK
            text = thought + _as_text(content or "") + calls_text + SENTENCE_END
        else:
            raise PromptError(f"Invalid role: {role}")

        nxt = self.msgs[pos + 1].get("role") if pos + 1 < len(self.msgs) else None
        if pos + 1 < len(self.msgs) and nxt not in ("assistant", "latest_reminder"):
            return text
        task = msg.get("task")
        if task is not None:
            if task not in TASKS:
                raise PromptError(f"Invalid task: {task!r}")
            if task == "action":
                text += ASSISTANT_TAG + (THINK if self.thinking else UNTHINK)
            return text + TASKS[task]
        if role in ("user", "developer") or (
            role == "system" and (pos == len(self.msgs) - 1 or nxt == "assistant")
        ):
            text += ASSISTANT_TAG
            if self.thinking and (not self.drop or pos >= self.cutoff):
                text += THINK
            else:
                text += UNTHINK
        return text


class DeepseekSimTokenizer(SimTokenizer):
    """A DeepSeek V3.2 (``mode="deepseek_v32"``) or V4 (``"deepseek_v4"``) model."""

    def __init__(self, model_dir: str | Path, mode: str) -> None:
        super().__init__(model_dir)
        if mode not in ("deepseek_v32", "deepseek_v4"):
            raise ValueError(f"not a DeepSeek encoder mode: {mode}")
        self.mode = mode
        self.content_format = "string" if mode == "deepseek_v32" else "openai"

    def render_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> str:
        from vllm_sim.engine_tokenizers import _vllm_tool_dump

        # vLLM's merge (build_chat_params(...).with_defaults(...)): the request's fields over
        # its chat_template_kwargs, those over the server's --default-chat-template-kwargs
        # and the tools, None and "auto" meaning unset; the effort as --reasoning-effort-map
        # rewrites it. The encoders read what they know of these keywords
        # (params.get_apply_chat_template_kwargs()); a --chat-template or a content format
        # has no say here (the renderer fixes the format, the encoder is the template).
        tools = kwargs.get("tools")
        # The request's own field: given by name, or riding on the messages (ChatMessages).
        effort_field = kwargs.get("reasoning_effort", getattr(messages, "reasoning_effort", None))
        options = chat_kwargs(
            kwargs.get("chat_template_kwargs"),
            tools=_vllm_tool_dump(tools) if tools is not None else None,
            documents=kwargs.get("documents"),
            reasoning_effort=effort_field,
            add_generation_prompt=bool(kwargs.get("add_generation_prompt", True)),
            continue_final_message=bool(kwargs.get("continue_final_message", False)),
            flags=kwargs.get("flags") or DEFAULT_FLAGS,
        )
        if "conversation" in options or "messages" in options:
            raise PromptError("apply_chat_template() got multiple values for a keyword argument")
        try:
            conversation = _vllm_conversation(messages, self.content_format)
            if self.mode == "deepseek_v32":
                return self._v32(conversation, options)
            return self._v4(conversation, options)
        except PromptError:
            raise
        except Exception as exc:  # vLLM answers the encoders' failures 400
            raise PromptError(str(exc)) from exc

    @staticmethod
    def _v32(conversation: list[dict[str, Any]], options: dict[str, Any]) -> str:
        thinking = bool(options.get("thinking", False) or options.get("enable_thinking", False))
        tools = options.get("tools")
        if tools:
            conversation.insert(0, {"role": "system", "tools": tools})
        return _V32Prompt(conversation, thinking).build()

    @staticmethod
    def _v4(conversation: list[dict[str, Any]], options: dict[str, Any]) -> str:
        if "thinking" in options or "enable_thinking" in options:
            thinking = bool(options.get("thinking")) or bool(options.get("enable_thinking"))
        else:
            thinking = True
        tools = options.get("tools")
        if tools:
            for pos, msg in enumerate(conversation):
                if msg.get("role") == "system":
                    conversation[pos] = {**msg, "tools": tools}
                    break
            else:
                conversation.insert(0, {"role": "system", "tools": tools})
        effort = options.get("reasoning_effort")
        if not isinstance(effort, str):
            effort = "high" if thinking else None
        elif effort == "none":
            thinking, effort = False, None
        elif effort != "max":
            effort = "low" if effort in ("low", "minimal", "medium") else "high"
        drop = bool(options.get("drop_thinking", True))
        return _V4Prompt(conversation, thinking, drop, effort).build()

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        add_special_tokens = bool(kwargs.pop("add_special_tokens", False))
        return self.encode(
            self.render_chat(messages, **kwargs), add_special_tokens=add_special_tokens
        )
