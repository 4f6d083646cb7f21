"""Counting for gpt-oss, whose chats vLLM renders with the harmony library.

vLLM never applies a chat template to a gpt-oss model (``model_type: gpt_oss``): it builds
harmony messages and has ``openai_harmony`` (the ``oss-harmony`` distribution, which embeds
the o200k_harmony vocabulary and works offline) render them for completion. Message texts
are encoded as plain text, so special-token look-alikes in them count as the text they are.
This counter builds the same messages:

1. a system message (model identity, knowledge cutoff, today's date, the reasoning effort,
   the valid channels); the effort word (low/medium/high) is one token whichever it is, so
   the count does not depend on the request's ``reasoning_effort``;
2. a developer message with a leading system/developer message's text as instructions and
   the request's function tools, when there is either;
3. the conversation: assistant tool calls on the commentary channel to ``functions.NAME``
   (content type ``json``, the arguments string as sent), prior text and reasoning on the
   commentary/analysis channels, assistant text on the final channel (dropped when its
   first part is empty), tool results from ``functions.NAME`` (the name found through the
   call id), later system/developer messages as developer instructions, user messages as
   they are;

then drops the analysis messages before the last final answer, renders for an assistant
turn, and rewrites prior tool-call headers to the older layout vLLM feeds gpt-oss
(``assistant to=R<|channel|>C T`` instead of ``assistant<|channel|>C to=R <|constrain|>T``).
Completions prompts and token-id prompts take the Hugging Face path (``PromptCounter``);
output text is counted as plain text.

A Responses request is not rendered as a chat: vLLM builds its harmony messages from the
input items directly (``vllm/renderers/online_renderer.py``:
``_render_responses_with_harmony``). Its converted chat messages arrive here as
:class:`HarmonyChatMessages`, which carry that conversation (:class:`HarmonyPrompt`, built by
``kvgate.responses_api.harmony``); this counter renders it instead of the chat messages, and
any other counter sees only the chat messages.
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvgate.tokenize.counter import CountPlan, PromptCounter
from kvgate.tokenize.errors import PromptRenderError, TokenizerLoadError
from kvgate.tokenize.messages import parse_messages

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, Message


#: The reasoning efforts harmony renders (vLLM refuses any other on a gpt-oss model).
HARMONY_EFFORTS: Final = ("low", "medium", "high")


@dataclass(frozen=True, slots=True)
class HarmonyTurn:
    """One harmony message of the conversation, as vLLM builds it from an input item.
    ``instructions``: a system or developer item, rendered as vLLM's instructions message
    (developer, or system with VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS) holding ``texts``
    joined."""

    role: str
    texts: tuple[str, ...]
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    author_name: str | None = None
    instructions: bool = False


@dataclass(frozen=True, slots=True)
class HarmonyPrompt:
    """A request vLLM renders through harmony directly (not as a chat): the preamble's
    ``instructions``, function ``tools`` (name, description, parameters) and
    ``reasoning_effort`` (the request's, before the server's effort map), then the
    ``turns``. ``refusal``: why vLLM's harmony path cannot
    render the request, or None; ``refusal_param``: the field it names."""

    instructions: str | None
    tools: tuple[tuple[str, str, dict[str, Any] | None], ...] | None
    reasoning_effort: str | None
    turns: tuple[HarmonyTurn, ...]
    refusal: str | None = None
    refusal_param: str | None = None


class HarmonyChatMessages(list[dict[str, Any]]):
    """Chat messages (what a chat-template model renders) that a gpt-oss model renders as
    ``harmony`` instead: vLLM's harmony path for the API builds its own messages."""

    def __init__(self, messages: list[dict[str, Any]], harmony: HarmonyPrompt) -> None:
        super().__init__(messages)
        self.harmony = harmony


def load_harmony_encoding() -> HarmonyEncoding:
    """gpt-oss's harmony encoding (embedded in oss-harmony: no download)."""
    from openai_harmony import HarmonyEncodingName
    from openai_harmony import load_harmony_encoding as load

    return load(HarmonyEncodingName.HARMONY_GPT_OSS)


class HarmonyPromptCounter(PromptCounter):
    """A gpt-oss model: chats through harmony, everything else as ``PromptCounter``."""

    # Instructions in the system message instead of a developer message, as vLLM renders
    # them with VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS set.
    instructions_in_system = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        text_engine, why = super().engine, self.engine_reason
        self.engine_reason = f"gpt-oss chats are rendered by harmony; other text by {text_engine}"
        if why:
            self.engine_reason += f" ({why})"
        try:
            self._harmony = load_harmony_encoding()
        except Exception as exc:  # the library is missing or cannot build its vocabulary
            raise TokenizerLoadError(self.name, f"the harmony encoding cannot load: {exc}") from exc
        special = self._harmony.encode
        self._start, self._channel, self._constrain, self._message = (
            special(text, allowed_special="all")[0]
            for text in ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")
        )
        # The library rebuilds this check on every strict encode (milliseconds): built once.
        names = sorted(self._harmony.special_tokens_set, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, names)))

    @property
    def has_chat_template(self) -> bool:
        return True

    @property
    def engine(self) -> str:
        """Chats are counted by the harmony library (completions by ``super().engine``)."""
        return "harmony"

    # -- chat ---------------------------------------------------------------------------------

    def plan_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> CountPlan:
        """Build the harmony messages now; rendering them is the deferred part."""
        # vLLM's harmony path renders for a new assistant turn whatever these say.
        del add_generation_prompt, continue_final_message, add_special_tokens
        if isinstance(messages, HarmonyChatMessages):
            # The API's own harmony messages (its tools are in them, as vLLM reads them),
            # with the request's effort as the server's effort map rewrites it.
            prompt = messages.harmony
            effort = getattr(chat_template_kwargs, "reasoning_effort", prompt.reasoning_effort)
            conversation = self.prompt_messages(prompt, effort=effort)
            chars = sum(len(text) for turn in prompt.turns for text in turn.texts)
            return CountPlan(0, [], 2 * chars, (lambda: len(self.render(conversation)),))
        conversation = self.harmony_messages(messages, tools)
        chars = sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, Mapping))
        # Weighed against the compiled BPE's characters (the service's inline bound): a
        # harmony render costs about twice as much per character.
        return CountPlan(0, [], 2 * chars, (lambda: len(self.render(conversation)),))

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt ids vLLM would run for this chat request."""
        return self.render(self.harmony_messages(messages, tools))

    def harmony_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[Message]:
        """The harmony messages vLLM builds for an OpenAI chat request."""
        parse_messages(messages, "openai")  # text parts only, as for every model
        if tools is not None and not isinstance(tools, list):
            raise PromptRenderError("tools must be a list")
        try:
            return _build_messages(
                [copy.deepcopy(dict(m)) for m in messages],
                tools,
                in_system=self.instructions_in_system,
            )
        except PromptRenderError:
            raise
        except Exception as exc:  # the library's own validation
            raise PromptRenderError(f"the request does not fit the harmony format: {exc}") from exc

    def prompt_messages(self, prompt: HarmonyPrompt, *, effort: str | None = None) -> list[Message]:
        """The harmony messages vLLM renders for ``prompt``: its preamble (vLLM's
        ``build_harmony_preamble``) with ``effort`` (the request's as the server rewrites
        it; None: the prompt's own), then its turns."""
        if prompt.refusal is not None:
            raise PromptRenderError(prompt.refusal, prompt.refusal_param)
        effort = prompt.reasoning_effort if effort is None else effort
        if effort is not None and effort not in HARMONY_EFFORTS:
            raise PromptRenderError(
                f"reasoning.effort: {effort!r} is not supported on gpt-oss models; supported "
                f"values are {', '.join(HARMONY_EFFORTS)}.",
                "reasoning.effort",
            )
        try:
            return _prompt_messages(prompt, effort, in_system=self.instructions_in_system)
        except PromptRenderError:
            raise
        except Exception as exc:  # the library's own validation
            raise PromptRenderError(f"the request does not fit the harmony format: {exc}") from exc

    def render(self, conversation: list[Message]) -> list[int]:
        from openai_harmony import Conversation, RenderConversationConfig, Role

        try:
            ids = self._harmony.render_conversation_for_completion(
                Conversation.from_messages(_drop_stale_analysis(conversation)),
                Role.ASSISTANT,
                config=RenderConversationConfig(auto_drop_analysis=False),
            )
            return self._legacy_tool_call_headers(list(ids))
        except PromptRenderError:
            raise
        except Exception as exc:  # the library's own refusals
            raise PromptRenderError(f"the request does not fit the harmony format: {exc}") from exc

    def _legacy_tool_call_headers(self, ids: list[int]) -> list[int]:
        """``<|start|>assistant<|channel|>C to=R <|constrain|>T<|message|>`` headers become
        ``<|start|>assistant to=R<|channel|>C T<|message|>``, as vLLM rewrites them."""
        out: list[int] = []
        i = 0
        while i < len(ids):
            if ids[i] != self._start:
                out.append(ids[i])
                i += 1
                continue
            rewritten, end = self._rewrite_header(ids, i)
            if rewritten is None:
                if end is None:  # not a complete header: keep the start token only
                    out.append(ids[i])
                    i += 1
                else:
                    out.extend(ids[i : end + 1])
                    i = end + 1
                continue
            out.extend(rewritten)
            i = end + 1 if end is not None else i + 1
        return out

    def _rewrite_header(self, ids: list[int], start: int) -> tuple[list[int] | None, int | None]:
        """(the header in the legacy layout or None, index of its <|message|> or None)."""
        try:
            end = ids.index(self._message, start + 1)
            channel = ids.index(self._channel, start + 1, end)
            constrain = ids.index(self._constrain, channel + 1, end)
        except ValueError:
            return None, None
        decode = self._harmony.decode
        author = decode(ids[start + 1 : channel])
        channel_and_recipient = decode(ids[channel + 1 : constrain])
        content_type = decode(ids[constrain + 1 : end])
        if author != "assistant" or not channel_and_recipient.endswith(" "):
            return None, end
        name, sep, recipient = channel_and_recipient[:-1].partition(" to=")
        if not sep or not name or not recipient or not content_type:
            return None, end
        head, tail = f"assistant to={recipient}", f"{name} {content_type}"
        found = self._special_text.search(head) or self._special_text.search(tail)
        if found:  # vLLM's strict encode refuses special-token text here
            raise PromptRenderError(f"a tool-call header holds the special token {found[0]!r}")
        encode = self._harmony.encode
        header = [
            self._start,
            *encode(head, disallowed_special=()),
            self._channel,
            *encode(tail, disallowed_special=()),
            self._message,
        ]
        return header, end

    # -- output ---------------------------------------------------------------------------------

    def plan_output(self, text: str) -> CountPlan:
        """Generated text is plain text: special-token look-alikes were generated as text."""
        if not isinstance(text, str):
            raise PromptRenderError("text must be a string")
        encode = self._harmony.encode
        return CountPlan(0, [], len(text), (lambda: len(encode(text, disallowed_special=())),))


# -- building the messages --------------------------------------------------------------------


def _joined_text(content: Any) -> str | None:
    """A content's text parts joined with nothing between them (None: no text at all)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [
        part if isinstance(part, str) else part.get("text")
        for part in content
        if isinstance(part, str | Mapping)
    ]
    present = [t for t in texts if t is not None]
    return "".join(present) if present else None


def _system_message(instructions: str | None = None, effort: str | None = None) -> Message:
    from openai_harmony import Message, ReasoningEffort, Role, SystemContent

    content = SystemContent.new()
    if effort is not None:
        content = content.with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    if instructions is not None:  # only when instructions go to the system message
        identity = content.model_identity
        content = content.with_model_identity(
            f"{identity}\n{instructions}" if identity else instructions
        )
    # vLLM dates the conversation with the server's local date: every YYYY-MM-DD date is
    # the same number of tokens, so a day boundary or time zone between the two cannot
    # change the count (tests/responses_api/test_harmony_prompt.py renders every day).
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    return Message.from_role_and_content(Role.SYSTEM, content.with_conversation_start_date(today))


def _developer_message(
    instructions: str | None, tools: list[dict[str, Any]] | None, *, in_system: bool
) -> Message:
    from openai_harmony import DeveloperContent, Message, Role, ToolDescription

    content = DeveloperContent.new()
    if instructions is not None and not in_system:
        content = content.with_instructions(instructions)
    described = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type", "function") if isinstance(tool, Mapping) else None
        if kind in ("web_search_preview", "code_interpreter", "container"):
            continue  # built-in tools are not described on the chat path
        function = tool.get("function") if kind == "function" else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise PromptRenderError(f"tools[{i}]: 'function' must be an object with a 'name'")
        described.append(
            ToolDescription.new(
                name=function["name"],
                description=function.get("description") or "",
                parameters=function.get("parameters"),
            )
        )
    if described:
        content = content.with_function_tools(described)
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _build_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, in_system: bool
) -> list[Any]:
    """``in_system``: instructions go to the system message (vLLM's
    VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS), else to a developer message."""
    instructions: str | None = None
    if messages and messages[0].get("role") in ("system", "developer"):
        instructions = _joined_text(messages[0].get("content"))
        messages = messages[1:]
    if in_system:
        out = [_system_message(instructions)]
        if tools:
            out.append(_developer_message(None, tools, in_system=True))
    else:
        out = [_system_message()]
        if instructions or tools:
            out.append(_developer_message(instructions, tools, in_system=False))

    names_by_call_id: dict[Any, Any] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, Mapping) else None
            names_by_call_id[call.get("id")] = (function or {}).get("name")
    for message in messages:
        out.extend(_conversation_message(message, names_by_call_id, in_system=in_system))
    return out


def _conversation_message(
    message: dict[str, Any], names_by_call_id: dict[Any, Any], *, in_system: bool
) -> list[Any]:
    from openai_harmony import Author, Message, Role, TextContent

    role = message.get("role")
    # The request model knows the older reasoning_content as reasoning.
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        built = []
        text = _joined_text(message.get("content"))
        if text:
            built.append(
                Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary")
            )
        if reasoning:
            built.append(
                Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis")
            )
        for call in calls:
            function = call.get("function") or {}
            built.append(
                Message.from_role_and_content(Role.ASSISTANT, function.get("arguments") or "")
                .with_channel("commentary")
                .with_recipient(f"functions.{function.get('name', '')}")
                .with_content_type("json")
            )
        return built
    if role == "tool":
        # A call without a name shows as "functions.None", as in vLLM.
        name = names_by_call_id.get(message.get("tool_call_id", ""), "")
        text = _joined_text(message.get("content")) or ""
        author = Author.new(Role.TOOL, f"functions.{name}")
        return [
            Message.from_author_and_content(author, text)
            .with_channel("commentary")
            .with_recipient("assistant")
        ]
    built = []
    if role == "assistant" and reasoning:
        built.append(
            Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis")
        )
    content = message.get("content") or ""
    parts = (
        [TextContent(text=content)]
        if isinstance(content, str)
        else [TextContent(text=part.get("text", "")) for part in content]
    )
    if role == "assistant":
        if parts and parts[0].text:
            built.append(Message.from_role_and_contents(role, parts).with_channel("final"))
    elif role in ("system", "developer"):
        instructions = _joined_text(message.get("content"))
        if instructions is not None and role == "system" and in_system:
            built.append(_system_message(instructions))
        elif instructions is not None:
            built.append(_developer_message(instructions, None, in_system=in_system))
    else:
        built.append(Message.from_role_and_contents(role, parts))
    return built


def _drop_stale_analysis(messages: list[Any]) -> list[Any]:
    """Reasoning before the last final answer is not shown to the model again."""
    last_final = max(
        (
            i
            for i, m in enumerate(messages)
            if m.author.role == "assistant" and m.channel == "final"
        ),
        default=-1,
    )
    return [m for i, m in enumerate(messages) if not (i < last_final and m.channel == "analysis")]


def _prompt_messages(prompt: HarmonyPrompt, effort: str | None, *, in_system: bool) -> list[Any]:
    from openai_harmony import Author, Message, Role, TextContent

    tools = (
        [
            {
                "type": "function",
                "function": {"name": name, "description": description, "parameters": parameters},
            }
            for name, description, parameters in prompt.tools
        ]
        if prompt.tools is not None
        else None
    )
    instructions = prompt.instructions
    out = [_system_message(instructions if in_system else None, effort)]
    if (instructions and not in_system) or tools:
        out.append(_developer_message(instructions, tools, in_system=in_system))
    for turn in prompt.turns:
        if turn.instructions:
            text = "".join(turn.texts)
            if turn.role == "system" and in_system:
                out.append(_system_message(text))
            else:
                out.append(_developer_message(text, None, in_system=in_system))
            continue
        contents = [TextContent(text=text) for text in turn.texts]
        if turn.author_name is not None:
            message = Message(
                author=Author.new(Role(turn.role), turn.author_name), content=contents
            )
        else:
            message = Message.from_role_and_contents(Role(turn.role), contents)
        if turn.channel is not None:
            message = message.with_channel(turn.channel)
        if turn.recipient is not None:
            message = message.with_recipient(turn.recipient)
        if turn.content_type is not None:
            message = message.with_content_type(turn.content_type)
        out.append(message)
    return out
