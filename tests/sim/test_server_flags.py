"""vLLM 0.34's server flags that change a rendered chat, on the simulator.

``--default-chat-template-kwargs``, ``--reasoning-effort-map``, ``--chat-template``,
``--chat-template-content-format`` and ``--exclude-tools-when-tool-choice-none`` reach the
prompt on POST /v1/chat/completions and POST /tokenize, in every prompt path (Hugging Face
templates, DeepSeek encoders, Mistral, harmony) as vLLM applies them. The expected prompts
are written by hand from vLLM's code (``renderers/online_renderer.py``,
``renderers/params.py``, ``renderers/hf.py``, ``renderers/chat_utils/chat_template.py``,
``entrypoints/serve/tokenize/serving.py``) and counted with the model's own tokenizer, or
rendered by the libraries vLLM calls (transformers, mistral_common, openai_harmony).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from openai_harmony import (
    Conversation,
    DeveloperContent,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from testbed.demo_model import demo_model_dir
from testbed.engine_models import (
    deepseek_v4_model_dir,
    deepseek_v32_model_dir,
    gpt_oss_model_dir,
    mistral_tekken_model_dir,
)
from testbed.harness import ManagedProcess, SimOptions, free_port, sim_argv
from testbed.hf_templates import TemplatesUnavailable, llama_cpp_templates, vocabulary_dir
from vllm_sim import SimConfig, create_app
from vllm_sim.chat_flags import BUILTIN_TEMPLATES_DIR
from vllm_sim.cli import build_parser, config_from_args, main
from vllm_sim.tokenization import SimTokenizer

transformers = pytest.importorskip("transformers")

HELLO = "Hello there, how are you?"
USER = [{"role": "user", "content": HELLO}]
# ChatML of one user turn with the generation prompt (Qwen2.5/Qwen3, vLLM's chatml).
TURN = f"<|im_start|>user\n{HELLO}<|im_end|>\n<|im_start|>assistant\n"
# The demo model's (Qwen2.5) template opens with its default system prompt.
DEMO_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
# Qwen3's template after the generation prompt when enable_thinking is false.
EMPTY_THINK = "<think>\n\n</think>\n\n"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

Serve = Callable[..., Awaitable[TestClient]]


# --- models and servers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    try:
        return llama_cpp_templates()
    except TemplatesUnavailable as exc:
        pytest.skip(f"real chat templates unavailable: {exc}")


@pytest.fixture(scope="module")
def qwen3(templates: dict[str, str]) -> str:
    return templates["Qwen-Qwen3-0.6B"]


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    """Qwen2's vocabulary without a chat template of its own."""
    return vocabulary_dir("qwen2")


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_dir: Path) -> SimTokenizer:
    return SimTokenizer(qwen_dir)


@pytest.fixture(scope="module")
def qwen_reference(qwen_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(qwen_dir))


@pytest.fixture(scope="module")
def demo_reference() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(demo_model_dir()))


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    clients: list[TestClient] = []

    async def factory(
        model_dir: Path, tokenizer: SimTokenizer | None = None, **flags: Any
    ) -> TestClient:
        config = SimConfig(model_dir=model_dir, served_model_name="m", **flags)
        client = TestClient(TestServer(create_app(config, tokenizer=tokenizer)))
        await client.start_server()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()


async def chat(client: TestClient, status: int = 200, **body: Any) -> dict[str, Any]:
    """A chat completion's answer (prompt_token_ids included)."""
    payload = {"model": "m", "messages": USER, "max_tokens": 1, "return_token_ids": True, **body}
    resp = await client.post("/v1/chat/completions", json=payload)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def chat_ids(client: TestClient, **body: Any) -> list[int]:
    answer = await chat(client, **body)
    assert answer["usage"]["prompt_tokens"] == len(answer["prompt_token_ids"])
    return list(answer["prompt_token_ids"])


async def tokenize_ids(client: TestClient, status: int = 200, **body: Any) -> Any:
    resp = await client.post("/tokenize", json={"model": "m", "messages": USER, **body})
    assert resp.status == status, await resp.text()
    answer = await resp.json()
    return answer["tokens"] if status == 200 else answer


def encoded(reference: Any, text: str) -> list[int]:
    return list(reference.encode(text, add_special_tokens=False))


# --- --default-chat-template-kwargs --------------------------------------------------------


async def test_default_kwargs_reach_the_template_on_both_routes(
    serve: Serve, qwen_dir: Path, qwen_tokenizer: SimTokenizer, qwen_reference: Any, qwen3: str
) -> None:
    """'{"enable_thinking": false}' (vLLM's own example): Qwen3 renders its empty think
    block after the generation prompt, on the chat route and on /tokenize."""
    plain = await serve(qwen_dir, qwen_tokenizer, chat_template=qwen3)
    assert await chat_ids(plain) == encoded(qwen_reference, TURN)
    assert await tokenize_ids(plain) == encoded(qwen_reference, TURN)

    off = await serve(
        qwen_dir,
        qwen_tokenizer,
        chat_template=qwen3,
        default_chat_template_kwargs={"enable_thinking": False},
    )
    expected = encoded(qwen_reference, TURN + EMPTY_THINK)
    assert await chat_ids(off) == expected
    assert await tokenize_ids(off) == expected


async def test_the_requests_keywords_win_over_the_defaults(
    serve: Serve, qwen_dir: Path, qwen_tokenizer: SimTokenizer, qwen_reference: Any, qwen3: str
) -> None:
    """ChatParams.with_defaults: the request's chat_template_kwargs and its reasoning_effort
    (enable_thinking = effort != "none") override the server's; None and "auto" do not."""
    client = await serve(
        qwen_dir,
        qwen_tokenizer,
        chat_template=qwen3,
        default_chat_template_kwargs={"enable_thinking": False},
    )
    thinking = encoded(qwen_reference, TURN)
    not_thinking = encoded(qwen_reference, TURN + EMPTY_THINK)
    on = {"enable_thinking": True}
    assert await chat_ids(client, chat_template_kwargs=on) == thinking
    assert await tokenize_ids(client, chat_template_kwargs=on) == thinking
    assert await chat_ids(client, reasoning_effort="high") == thinking
    # The client's own switch beats the one the effort implies.
    off = {"enable_thinking": False}
    assert await chat_ids(client, reasoning_effort="high", chat_template_kwargs=off) == (
        not_thinking
    )
    for unset in (None, "auto"):
        kwargs = {"enable_thinking": unset}
        assert await chat_ids(client, chat_template_kwargs=kwargs) == not_thinking
        assert await tokenize_ids(client, chat_template_kwargs=kwargs) == not_thinking


async def test_default_tools_are_used_when_the_request_has_none(
    serve: Serve, demo_reference: Any
) -> None:
    """preprocess_chat merges the request's tools over the defaults, a None left out: a
    "tools" default renders when the request sends no tools."""
    with_tools = await serve(demo_model_dir())
    reference = await chat_ids(with_tools, tools=TOOLS)
    defaults = await serve(demo_model_dir(), default_chat_template_kwargs={"tools": TOOLS})
    assert await chat_ids(defaults) == reference
    assert await tokenize_ids(defaults) == reference
    assert len(reference) > len(encoded(demo_reference, DEMO_SYSTEM + TURN))


async def test_template_keys_among_the_defaults(
    serve: Serve, sim_tokenizer: SimTokenizer, demo_reference: Any, model_dir: Path
) -> None:
    """preprocess_chat puts vLLM's own tokenize over the defaults (a default "tokenize" has
    no say), and get_apply_chat_template_kwargs puts ChatParams.chat_template over them: a
    default "chat_template" renders only when neither the request nor --chat-template names
    one."""
    printed = f"[{HELLO}]"
    tokenize = await serve(
        model_dir, sim_tokenizer, default_chat_template_kwargs={"tokenize": True}
    )
    assert await chat_ids(tokenize) == encoded(demo_reference, DEMO_SYSTEM + TURN)
    defaults = {"chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}
    by_default = await serve(model_dir, sim_tokenizer, default_chat_template_kwargs=defaults)
    assert await chat_ids(by_default) == encoded(demo_reference, printed)
    assert await tokenize_ids(by_default) == encoded(demo_reference, printed)
    own = "{% for m in messages %}({{ m['content'] }}){% endfor %}"
    assert await chat_ids(by_default, chat_template=own) == encoded(demo_reference, f"({HELLO})")
    flagged = await serve(
        model_dir, sim_tokenizer, default_chat_template_kwargs=defaults, chat_template=own
    )
    assert await chat_ids(flagged) == encoded(demo_reference, f"({HELLO})")


async def test_default_kwargs_reach_the_deepseek_encoders(serve: Serve) -> None:
    """params.get_apply_chat_template_kwargs() carries the defaults to the DeepSeek
    encoders: V3.2 thinks with "thinking" (its prompt ends "<think>", else "</think>"); V4
    takes its effort from them when the request gives none."""
    v32_dir = deepseek_v32_model_dir()
    v32_reference = transformers.AutoTokenizer.from_pretrained(str(v32_dir))
    plain = await serve(v32_dir)
    thinking = await serve(v32_dir, default_chat_template_kwargs={"thinking": True})
    assert v32_reference.decode(await chat_ids(plain)).endswith("<｜Assistant｜></think>")  # noqa: RUF001
    ids = await chat_ids(thinking)
    assert v32_reference.decode(ids).endswith("<｜Assistant｜><think>")  # noqa: RUF001
    assert await tokenize_ids(thinking) == ids
    assert await chat_ids(plain, chat_template_kwargs={"thinking": True}) == ids

    v4_dir = deepseek_v4_model_dir()
    v4_reference = transformers.AutoTokenizer.from_pretrained(str(v4_dir))
    plain = await serve(v4_dir)
    maximal = await serve(v4_dir, default_chat_template_kwargs={"reasoning_effort": "max"})
    max_ids = await chat_ids(plain, reasoning_effort="max")
    assert "Reasoning Effort: Beyond maximum" in v4_reference.decode(max_ids)
    assert await chat_ids(maximal) == max_ids
    assert await tokenize_ids(maximal) == max_ids
    assert "Beyond maximum" not in v4_reference.decode(await chat_ids(plain))
    # The request's own effort still wins.
    assert await chat_ids(maximal, reasoning_effort="low") == await chat_ids(
        plain, reasoning_effort="low"
    )


async def test_a_client_that_names_enable_thinking_decides_it_on_the_deepseek_encoders(
    serve: Serve,
) -> None:
    """build_chat_params switches thinking by the effort only when the client's
    chat_template_kwargs lack enable_thinking: named as null, the switch stays off and the
    null is then dropped by the merge with the server's defaults, so the server's default
    (else the encoder's own) decides."""
    null = {"enable_thinking": None}
    v32_dir = deepseek_v32_model_dir()
    v32_reference = transformers.AutoTokenizer.from_pretrained(str(v32_dir))

    async def v32_thinks(client: TestClient, **body: Any) -> bool:
        text = v32_reference.decode(await chat_ids(client, **body))
        assert text.endswith(("<｜Assistant｜><think>", "<｜Assistant｜></think>")), text  # noqa: RUF001
        return bool(text.endswith("<think>"))

    plain = await serve(v32_dir)
    assert await v32_thinks(plain, reasoning_effort="high")
    # V3.2 does not think unless told: the null leaves it at that.
    assert not await v32_thinks(plain, reasoning_effort="high", chat_template_kwargs=null)
    on = await serve(v32_dir, default_chat_template_kwargs={"enable_thinking": True})
    assert not await v32_thinks(on, reasoning_effort="none")
    assert await v32_thinks(on, reasoning_effort="none", chat_template_kwargs=null)

    v4_dir = deepseek_v4_model_dir()
    plain = await serve(v4_dir)
    off = await serve(v4_dir, default_chat_template_kwargs={"enable_thinking": False})
    not_thinking = await chat_ids(
        plain, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}
    )
    thinking = await chat_ids(plain, reasoning_effort="high")
    assert not_thinking != thinking
    assert await chat_ids(off, reasoning_effort="high", chat_template_kwargs=null) == not_thinking
    assert await chat_ids(off, reasoning_effort="high") == thinking
    # No default: V4's own (thinking on) decides.
    assert await chat_ids(plain, reasoning_effort="high", chat_template_kwargs=null) == thinking


def _mistral_reference(messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    mistral = MistralTokenizer.from_file(
        str(mistral_tekken_model_dir() / "tekken.json"), mode=ValidationMode.test
    )
    request = ChatCompletionRequest.from_openai(messages, tools=tools)
    return list(mistral.encode_chat_completion(request).tokens)


async def test_mistral_hands_the_defaults_to_mistral_common(serve: Serve) -> None:
    """vLLM's MistralTokenizer passes the keywords to ChatCompletionRequest.from_openai,
    which drops the fields it does not know (a --chat-template travels along unused) and
    refuses a reasoning_effort this tokenizer version does not support."""
    model_dir = mistral_tekken_model_dir()
    unknown = {"enable_thinking": False, "documents": [{"text": "x"}], "cohere_format": "cmd3"}
    ignored = await serve(
        model_dir, default_chat_template_kwargs=unknown, chat_template="{{ 'ignored' }}"
    )
    assert await chat_ids(ignored) == _mistral_reference(USER)
    assert await tokenize_ids(ignored) == _mistral_reference(USER)

    effort = await serve(model_dir, default_chat_template_kwargs={"reasoning_effort": "high"})
    refused = await chat(effort, status=400)
    assert "reasoning_effort='high' is not supported for this model" in refused["error"]["message"]
    refused = await tokenize_ids(effort, status=400)
    assert "reasoning_effort='high' is not supported for this model" in refused["error"]["message"]


async def test_harmony_ignores_the_template_flags(serve: Serve) -> None:
    """gpt-oss chats are built by harmony: no template, keywords or content format."""
    model_dir = gpt_oss_model_dir()
    plain = await chat_ids(await serve(model_dir))
    flagged = await serve(
        model_dir,
        default_chat_template_kwargs={"reasoning_effort": "high", "enable_thinking": False},
        chat_template="{{ 'ignored' }}",
        chat_template_content_format="string",
    )
    assert await chat_ids(flagged) == plain
    assert await tokenize_ids(flagged) == plain


# --- --reasoning-effort-map ----------------------------------------------------------------


async def test_the_map_rewrites_the_effort_before_the_thinking_switch(
    serve: Serve, qwen_dir: Path, qwen_tokenizer: SimTokenizer, qwen_reference: Any, qwen3: str
) -> None:
    """build_chat_params maps the effort first: "none" mapped to "low" thinks."""
    plain = await serve(qwen_dir, qwen_tokenizer, chat_template=qwen3)
    assert await chat_ids(plain, reasoning_effort="none") == encoded(
        qwen_reference, TURN + EMPTY_THINK
    )
    mapped = await serve(
        qwen_dir, qwen_tokenizer, chat_template=qwen3, reasoning_effort_map={"none": "low"}
    )
    assert await chat_ids(mapped, reasoning_effort="none") == encoded(qwen_reference, TURN)
    # Efforts not listed pass unchanged.
    assert await chat_ids(mapped, reasoning_effort="high") == encoded(qwen_reference, TURN)


async def test_the_map_fits_efforts_to_a_template_that_knows_few(
    serve: Serve, templates: dict[str, str]
) -> None:
    """Tencent Hy3's template accepts high, low and no_think and raises on any other
    effort: unmapped, "medium" is refused (400); mapped to "low" it renders with
    reasoning_effort "low" (and enable_thinking true), as transformers renders it."""
    hy3 = templates["tencent-Hy3"]
    model_dir = vocabulary_dir("llama3")
    tokenizer = SimTokenizer(model_dir)
    reference = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    plain = await serve(model_dir, tokenizer, chat_template=hy3)
    refused = await chat(plain, status=400, reasoning_effort="medium")
    assert "reasoning_effort error : medium" in refused["error"]["message"]

    mapped = await serve(
        model_dir, tokenizer, chat_template=hy3, reasoning_effort_map={"medium": "low"}
    )
    text = reference.apply_chat_template(
        USER,
        chat_template=hy3,
        tokenize=False,
        add_generation_prompt=True,
        reasoning_effort="low",
        enable_thinking=True,
    )
    assert "reasoning_effort:low" in text
    assert await chat_ids(mapped, reasoning_effort="medium") == encoded(reference, text)


async def test_the_map_reaches_the_deepseek_v4_effort(serve: Serve) -> None:
    model_dir = deepseek_v4_model_dir()
    plain = await serve(model_dir)
    mapped = await serve(model_dir, reasoning_effort_map={"medium": "max"})
    assert await chat_ids(mapped, reasoning_effort="medium") == await chat_ids(
        plain, reasoning_effort="max"
    )
    assert await chat_ids(plain, reasoning_effort="medium") != await chat_ids(
        plain, reasoning_effort="max"
    )


async def test_the_map_reaches_mistral_common(serve: Serve) -> None:
    mapped = await serve(mistral_tekken_model_dir(), reasoning_effort_map={"high": "none"})
    refused = await chat(mapped, status=400, reasoning_effort="high")
    assert "reasoning_effort='none' is not supported" in refused["error"]["message"]


def _harmony_reference(effort: ReasoningEffort | None, tools: Any = None) -> list[int]:
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    system = SystemContent.new()
    if effort is not None:
        system = system.with_reasoning_effort(effort)
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    messages = [
        Message.from_role_and_content(Role.SYSTEM, system.with_conversation_start_date(today))
    ]
    if tools:
        described = [
            ToolDescription.new(
                name=t["function"]["name"],
                description=t["function"]["description"],
                parameters=t["function"]["parameters"],
            )
            for t in tools
        ]
        messages.append(
            Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_function_tools(described)
            )
        )
    messages.append(Message.from_role_and_content(Role.USER, HELLO))
    return list(
        encoding.render_conversation_for_completion(
            Conversation.from_messages(messages), Role.ASSISTANT
        )
    )


async def test_harmony_takes_the_mapped_effort(serve: Serve) -> None:
    """_make_request_with_harmony: the mapped effort sets the system message's
    "Reasoning:"; "none" and efforts harmony lacks (max, xhigh, minimal) are refused."""
    model_dir = gpt_oss_model_dir()
    plain = await serve(model_dir)
    assert await chat_ids(plain) == _harmony_reference(None)
    assert await chat_ids(plain, reasoning_effort="low") == _harmony_reference(ReasoningEffort.LOW)
    refused = await chat(plain, status=400, reasoning_effort="none")
    assert "Harmony does not support reasoning_effort='none'" in refused["error"]["message"]
    refused = await chat(plain, status=400, reasoning_effort="max")
    assert "reasoning_effort='max' is not supported by Harmony" in refused["error"]["message"]

    mapped = await serve(model_dir, reasoning_effort_map={"max": "high", "none": "low"})
    high = _harmony_reference(ReasoningEffort.HIGH)
    assert await chat_ids(mapped, reasoning_effort="max") == high
    assert await chat_ids(mapped, reasoning_effort="none") == _harmony_reference(
        ReasoningEffort.LOW
    )
    assert high != _harmony_reference(None)


def test_the_map_is_checked_as_vllm_checks_it(model_dir: Path) -> None:
    for bad, message in (
        ({"extreme": "high"}, r"unknown efforts \['extreme'\]; keys must be one of"),
        ({"high": 1}, "must be a JSON object mapping reasoning efforts to strings"),
        (["high"], "must be a JSON object mapping reasoning efforts to strings"),
    ):
        with pytest.raises(ValueError, match=message):
            SimConfig(model_dir=model_dir, served_model_name="m", reasoning_effort_map=bad)
        argv = ["--model-dir", str(model_dir), "--reasoning-effort-map", json.dumps(bad)]
        with pytest.raises(SystemExit, match=message):
            main(argv)


# --- --chat-template -----------------------------------------------------------------------


def _loaded(model_dir: Path, value: str) -> str | None:
    args = build_parser().parse_args(["--model-dir", str(model_dir), "--chat-template", value])
    return config_from_args(args).chat_template


def test_the_template_is_read_as_vllm_reads_it(model_dir: Path, tmp_path: Path) -> None:
    """load_chat_template: a file that opens is read; a value without "{", "}" or a newline
    names one of vLLM's bundled templates; anything else is the template itself."""
    template = tmp_path / "t.jinja"
    template.write_text("{{ 'from a file' }}", encoding="utf-8")
    assert _loaded(model_dir, str(template)) == "{{ 'from a file' }}"
    braced = tmp_path / "{braced}.jinja"  # a file, though its name holds a brace
    braced.write_text("{{ 'braced' }}", encoding="utf-8")
    assert _loaded(model_dir, str(braced)) == "{{ 'braced' }}"
    assert _loaded(model_dir, "{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert _loaded(model_dir, "no braces\nbut a newline") == "no braces\nbut a newline"
    chatml = _loaded(model_dir, "template_chatml.jinja")
    assert chatml is not None and chatml.startswith("{%- for message in messages -%}")
    assert chatml == (BUILTIN_TEMPLATES_DIR / "template_chatml.jinja").read_text("utf-8")
    assert _loaded(model_dir, "template_basic.jinja") is not None
    with pytest.raises(ValueError, match="appears path-like, but doesn't exist"):
        _loaded(model_dir, str(tmp_path / "missing.jinja"))
    with pytest.raises(SystemExit, match="appears path-like, but doesn't exist"):
        main(["--model-dir", str(model_dir), "--chat-template", "missing.jinja"])
    with pytest.raises(ValueError, match="looks like a file path, but it failed to be opened"):
        _loaded(model_dir, str(tmp_path))  # exists, but a directory


async def test_the_server_template_replaces_the_models(
    serve: Serve, sim_tokenizer: SimTokenizer, demo_reference: Any, model_dir: Path
) -> None:
    """vLLM's bundled chatml has no default system prompt, unlike the demo's Qwen2.5."""
    plain = await serve(model_dir, sim_tokenizer)
    assert await chat_ids(plain) == encoded(demo_reference, DEMO_SYSTEM + TURN)
    chatml = await serve(
        model_dir, sim_tokenizer, chat_template=_loaded(model_dir, "template_chatml.jinja")
    )
    assert await chat_ids(chatml) == encoded(demo_reference, TURN)
    assert await tokenize_ids(chatml) == encoded(demo_reference, TURN)
    # A request's own template still comes first (request.chat_template or the default).
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert await chat_ids(chatml, chat_template=own) == encoded(demo_reference, f"[{HELLO}]")
    assert await tokenize_ids(chatml, chat_template=own) == encoded(demo_reference, f"[{HELLO}]")


async def test_a_model_without_a_template_serves_with_one(
    serve: Serve,
    qwen_dir: Path,
    qwen_tokenizer: SimTokenizer,
    qwen_reference: Any,
    qwen3: str,
    tmp_path: Path,
) -> None:
    bare = await serve(qwen_dir, qwen_tokenizer)
    await chat(bare, status=400)
    path = tmp_path / "qwen3.jinja"
    path.write_text(qwen3, encoding="utf-8")
    served = await serve(qwen_dir, qwen_tokenizer, chat_template=_loaded(qwen_dir, str(path)))
    assert await chat_ids(served) == encoded(qwen_reference, TURN)


# --- --chat-template-content-format --------------------------------------------------------

PRINTS_CONTENT = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
LOOPS_OVER_PARTS = (
    "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
)


async def test_a_given_content_format_wins_over_the_detected_one(
    serve: Serve, sim_tokenizer: SimTokenizer, demo_reference: Any, model_dir: Path
) -> None:
    """resolve_chat_template_content_format: "auto" detects ("string" for a template that
    prints the content, "openai" for one that loops over its parts); a given format wins."""
    detected = await serve(model_dir, sim_tokenizer, chat_template=PRINTS_CONTENT)
    assert await chat_ids(detected) == encoded(demo_reference, f"[{HELLO}]")
    openai = await serve(
        model_dir,
        sim_tokenizer,
        chat_template=PRINTS_CONTENT,
        chat_template_content_format="openai",
    )
    as_parts = f"[[{{'type': 'text', 'text': '{HELLO}'}}]]"
    assert await chat_ids(openai) == encoded(demo_reference, as_parts)
    assert await tokenize_ids(openai) == encoded(demo_reference, as_parts)

    detected = await serve(model_dir, sim_tokenizer, chat_template=LOOPS_OVER_PARTS)
    assert await chat_ids(detected) == encoded(demo_reference, f"<{HELLO}>")
    string = await serve(
        model_dir,
        sim_tokenizer,
        chat_template=LOOPS_OVER_PARTS,
        chat_template_content_format="string",
    )
    # The loop walks the text's characters, which have no "text": one "<>" per character.
    assert await chat_ids(string) == encoded(demo_reference, "<>" * len(HELLO))
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert await tokenize_ids(string, messages=parts) == encoded(demo_reference, "<>" * 3)


# --- --exclude-tools-when-tool-choice-none -------------------------------------------------


async def test_tools_are_left_out_when_tool_choice_is_none(
    serve: Serve, sim_tokenizer: SimTokenizer, model_dir: Path
) -> None:
    """OnlineRenderer.render_chat: with the flag, tool_choice "none" renders no tools; other
    choices (and the "auto" that tools without a choice mean) keep them. /tokenize has no
    tool_choice field: its tools always render."""
    plain = await serve(model_dir, sim_tokenizer)
    flagged = await serve(model_dir, sim_tokenizer, exclude_tools_when_tool_choice_none=True)
    without = await chat_ids(plain)
    with_tools = await chat_ids(plain, tools=TOOLS)
    assert len(with_tools) > len(without)
    assert await chat_ids(plain, tools=TOOLS, tool_choice="none") == with_tools
    assert await chat_ids(flagged, tools=TOOLS, tool_choice="none") == without
    assert await chat_ids(flagged, tools=TOOLS, tool_choice="auto") == with_tools
    assert await chat_ids(flagged, tools=TOOLS) == with_tools
    assert await tokenize_ids(flagged, tools=TOOLS) == with_tools
    # An empty list is no tools: "auto" falls back to "none" (vLLM's check_tool_usage).
    assert await chat_ids(flagged, tools=[], tool_choice="auto") == without


async def test_mistral_and_harmony_leave_the_tools_out_too(serve: Serve) -> None:
    mistral_dir = mistral_tekken_model_dir()
    flagged = await serve(mistral_dir, exclude_tools_when_tool_choice_none=True)
    plain = await serve(mistral_dir)
    with_tools = _mistral_reference(USER, TOOLS)
    assert with_tools != _mistral_reference(USER)
    assert await chat_ids(plain, tools=TOOLS, tool_choice="none") == with_tools
    assert await chat_ids(flagged, tools=TOOLS, tool_choice="none") == _mistral_reference(USER)
    assert await chat_ids(flagged, tools=TOOLS) == with_tools

    gpt_oss_dir = gpt_oss_model_dir()
    flagged = await serve(gpt_oss_dir, exclude_tools_when_tool_choice_none=True)
    plain = await serve(gpt_oss_dir)
    with_tools = _harmony_reference(None, TOOLS)
    assert await chat_ids(plain, tools=TOOLS, tool_choice="none") == with_tools
    assert await chat_ids(flagged, tools=TOOLS, tool_choice="none") == _harmony_reference(None)
    # /tokenize's chat request defaults tool_choice to "auto" when it has tools.
    assert await tokenize_ids(flagged, tools=TOOLS) == with_tools


# --- the command line and the test bed -----------------------------------------------------


def test_the_flags_parse_into_the_config(model_dir: Path) -> None:
    args = build_parser().parse_args(
        [
            "--model-dir",
            str(model_dir),
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
            "--reasoning-effort-map",
            '{"medium": "low"}',
            "--chat-template",
            "{{ 'x' }}",
            "--chat-template-content-format",
            "openai",
            "--exclude-tools-when-tool-choice-none",
        ]
    )
    flags = config_from_args(args).chat_flags
    assert flags.default_chat_template_kwargs == {"enable_thinking": False}
    assert flags.template_defaults == {"enable_thinking": False, "cohere_format": "cmd4"}
    assert flags.reasoning_effort_map == {"medium": "low"}
    assert flags.chat_template == "{{ 'x' }}"
    assert flags.chat_template_content_format == "openai"
    assert flags.exclude_tools_when_tool_choice_none is True

    defaults = config_from_args(build_parser().parse_args(["--model-dir", str(model_dir)]))
    assert defaults.chat_flags.template_defaults == {"cohere_format": "cmd4"}
    assert defaults.chat_template is None and defaults.chat_template_content_format == "auto"
    assert not defaults.exclude_tools_when_tool_choice_none and not defaults.reasoning_effort_map
    for bad in (
        ["--default-chat-template-kwargs", "{not json"],
        ["--chat-template-content-format", "x"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model-dir", str(model_dir), *bad])
    with pytest.raises(SystemExit, match="must be a JSON object"):
        main(["--model-dir", str(model_dir), "--default-chat-template-kwargs", "[1]"])
    with pytest.raises(ValueError, match="chat_template_content_format"):
        SimConfig(model_dir=model_dir, served_model_name="m", chat_template_content_format="x")


def test_the_test_bed_passes_the_flags(model_dir: Path) -> None:
    assert SimOptions().argv() == ["--num-gpu-blocks", "3000", "--block-size", "16"]
    options = SimOptions(
        default_chat_template_kwargs={"enable_thinking": False},
        reasoning_effort_map={"medium": "low"},
        chat_template="template_chatml.jinja",
        chat_template_content_format="openai",
        exclude_tools_when_tool_choice_none=True,
    )
    argv = sim_argv(8000, options, model_dir=model_dir, served_model_name="m")
    config = config_from_args(build_parser().parse_args(argv[1:]))
    assert config.chat_flags.default_chat_template_kwargs == {"enable_thinking": False}
    assert config.chat_flags.reasoning_effort_map == {"medium": "low"}
    assert config.chat_template == (BUILTIN_TEMPLATES_DIR / "template_chatml.jinja").read_text(
        "utf-8"
    )
    assert config.chat_template_content_format == "openai"
    assert config.exclude_tools_when_tool_choice_none is True


def test_a_test_bed_simulator_renders_with_the_flags(
    model_dir: Path, demo_reference: Any, tmp_path: Path
) -> None:
    """The real process, started by the harness with SimOptions' flags."""
    import urllib.request

    port = free_port()
    options = SimOptions(chat_template="template_chatml.jinja")
    proc = ManagedProcess(
        "vllm-sim-flags",
        sim_argv(port, options, model_dir=model_dir, served_model_name="m"),
        log_dir=tmp_path,
    )
    proc.start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/tokenize",
            data=json.dumps({"model": "m", "messages": USER}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            answer = json.loads(resp.read())
    finally:
        proc.stop()
    assert answer["tokens"] == encoded(demo_reference, TURN)
