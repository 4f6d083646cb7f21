"""kvgate counts what vLLM 0.34 counts on real Hugging Face chat templates.

The reference is the simulator's path (``vllm_sim.tokenization.SimTokenizer``): transformers'
``AutoTokenizer.apply_chat_template`` on messages preprocessed by the simulator's own
reproduction of vLLM's request handling, which shares no code with kvgate. Templates are the
~70 real ones in the llama-cpp-python source distribution (fetched with pip at test time);
vocabularies are real ones shipped in PyPI packages (testbed.hf_templates). Every case is
hostile in one way: developer role, several system messages, tools with unknown keys, tool
calls whose arguments are JSON strings, non-object JSON or invalid JSON, content parts,
reasoning_effort, Claude Code's billing header, empty messages, long texts.

Per template and case both paths must agree: the same count, or both refuse. A summary of
every template family is written to ``var/reports/hf_template_parity.md``.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvgate.tokenize import PromptCounter
from kvgate.tokenize.chat_template import ChatTemplate
from kvgate.tokenize.errors import PromptRenderError
from kvgate.tokenize.request_fields import with_request_fields
from testbed.demo_model import REPO_ROOT
from testbed.hf_templates import (
    TemplatesUnavailable,
    llama_cpp_templates,
    vocabulary_dir,
    vocabulary_for,
)

vllm_sim_tokenization = pytest.importorskip("vllm_sim.tokenization")
pytest.importorskip("transformers")

REPORT = REPO_ROOT / "var" / "reports" / "hf_template_parity.md"

# Templates vLLM does not render through the Hugging Face path, whatever the file says:
# gpt-oss chats go through harmony; DeepSeek V3.2 / V4 architectures get vLLM's Python
# encoders (their own parity suites cover those).
NOT_HF_PATH = {
    "openai-gpt-oss-120b": "gpt-oss is rendered by harmony in vLLM",
    "deepseek-ai-DeepSeek-V3.2": "vLLM's deepseek_v32 mode encodes in Python",
    "deepseek-ai-DeepSeek-V4": "vLLM's deepseek_v4 mode encodes in Python",
    "deepseek-ai-DeepSeek-V4-Flash-0731": "vLLM's deepseek_v4 mode encodes in Python",
}

BILLING = "x-anthropic-billing-header: cc_version=2.1.37; cc_entrypoint=cli; cch=9f8e7;"
LONG_TEXT = ("Ünïcödé — 東京 🚀 tabs\tand  spaces\n\n" * 40 + "lorem ipsum dolor " * 600).strip()
WEATHER_TOOL = {
    "type": "function",
    "x-vendor-meta": {"owner": "team-a", "notes": "n " * 200},
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
        "strict": True,
        "cache_control": {"type": "ephemeral"},
    },
}
BARE_TOOL = {"type": "function", "function": {"name": "ping"}, "defer_loading": True}


def _call(arguments: Any, call_id: str = "call_1") -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


def _tool_turn(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [_call(arguments)]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ]


@dataclass(frozen=True)
class Case:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("plain", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
    Case(
        "developer",
        [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
    ),
    Case(
        "developer-late",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "developer", "content": [{"type": "text", "text": "Use metric units."}]},
            {"role": "user", "content": "Weather?"},
        ],
    ),
    Case(
        "several-system",
        [
            {"role": "system", "content": "One."},
            {"role": "system", "content": "Two."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Three."},
            {"role": "user", "content": "Again"},
        ],
    ),
    Case("tools-unknown-keys", [{"role": "user", "content": "Hi"}], [WEATHER_TOOL, BARE_TOOL]),
    Case("arguments-json-string", _tool_turn('{"city": "Paris"}'), [WEATHER_TOOL]),
    Case("arguments-json-array", _tool_turn("[1, 2, 3]"), [WEATHER_TOOL]),
    Case("arguments-json-number", _tool_turn("42"), [WEATHER_TOOL]),
    Case("arguments-invalid-json", _tool_turn('{"city": "Par'), [WEATHER_TOOL]),
    Case("arguments-empty", _tool_turn(""), [WEATHER_TOOL]),
    Case("arguments-list-as-is", _tool_turn(["Paris"]), [WEATHER_TOOL]),
    Case(
        "content-parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "Sys A"}, "Sys B"]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first"},
                    {"type": "input_text", "text": "second"},
                    {"type": "text", "text": ""},
                    "",
                    "third",
                ],
            },
        ],
    ),
    Case(
        "tool-result-parts",
        [
            *_tool_turn('{"city": "Paris"}')[:2],
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "21C"}, {"type": "text", "text": "sunny"}],
            },
        ],
        [WEATHER_TOOL],
    ),
    Case("effort-low", [{"role": "user", "content": "Think about it."}], reasoning_effort="low"),
    Case("effort-none", [{"role": "user", "content": "Quick."}], reasoning_effort="none"),
    Case(
        "effort-high-client-switch",
        [{"role": "user", "content": "Hi"}],
        reasoning_effort="high",
        chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"},
    ),
    Case(
        "kwargs-unset-values",
        [{"role": "user", "content": "Hi"}],
        chat_template_kwargs={"enable_thinking": None, "reasoning_effort": "auto"},
    ),
    Case(
        "billing-header",
        [
            {"role": "system", "content": f"{BILLING}\nYou are a coding agent."},
            {"role": "user", "content": f"{BILLING}\nuser text keeps it"},
        ],
    ),
    Case(
        "billing-header-parts",
        [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": BILLING},
                    {"type": "text", "text": "You are a coding agent.", "cache_control": {}},
                ],
            },
            {"role": "user", "content": "Hi"},
        ],
    ),
    Case("empty-conversation", []),
    Case(
        "empty-contents",
        [
            {"role": "system", "content": ""},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": None},
            {"role": "user", "content": []},
        ],
    ),
    Case(
        "long-text",
        [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": LONG_TEXT}],
    ),
    Case(
        "reasoning-history",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them: 4."},
            {"role": "user", "content": "3+3?"},
        ],
    ),
    Case(
        "continue-final",
        [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Snow"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    Case(
        "continue-user",
        [{"role": "user", "content": "Complete this sentence: the sky"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    Case(
        "no-generation-prompt",
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        add_generation_prompt=False,
    ),
]

Outcome = int | str  # a count, or "refused: <why>"


def _outcome(count: Callable[[], int], refusals: tuple[type[BaseException], ...]) -> Outcome:
    try:
        return count()
    except refusals as exc:
        return f"refused: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}"


@dataclass
class Vocabulary:
    directory: Path
    engine: Any  # the simulator's tokenizer


@pytest.fixture(scope="session")
def templates() -> dict[str, str]:
    try:
        return llama_cpp_templates()
    except TemplatesUnavailable as exc:
        pytest.skip(f"real chat templates unavailable: {exc}")


@pytest.fixture(scope="session")
def vocabularies() -> dict[str, Vocabulary]:
    return {}


def _vocabulary(cache: dict[str, Vocabulary], name: str) -> Vocabulary:
    if name not in cache:
        directory = vocabulary_dir(name)
        cache[name] = Vocabulary(directory, vllm_sim_tokenization.SimTokenizer(directory))
    return cache[name]


def _kvgate_counter(vocabulary: Vocabulary, source: str) -> PromptCounter:
    base = PromptCounter.from_model_dir(vocabulary.directory)
    config = json.loads((vocabulary.directory / "tokenizer_config.json").read_text("utf-8"))
    specials = {
        key: config[key] for key in ("bos_token", "eos_token") if isinstance(config.get(key), str)
    }
    return PromptCounter(base._tokenizer, config, ChatTemplate(source, specials), name="parity")


def _kvgate_count(counter: PromptCounter, case: Case) -> Outcome:
    kwargs = with_request_fields(
        copy.deepcopy(case.chat_template_kwargs), reasoning_effort=case.reasoning_effort
    )
    return _outcome(
        lambda: counter.count_chat(
            copy.deepcopy(case.messages),
            copy.deepcopy(case.tools),
            add_generation_prompt=case.add_generation_prompt,
            continue_final_message=case.continue_final_message,
            chat_template_kwargs=kwargs,
        ),
        (PromptRenderError,),
    )


def _engine_count(vocabulary: Vocabulary, source: str, case: Case) -> Outcome:
    messages = vllm_sim_tokenization.ChatMessages(copy.deepcopy(case.messages))
    messages.reasoning_effort = case.reasoning_effort
    return _outcome(
        lambda: len(
            vocabulary.engine.encode_chat(
                messages,
                tools=copy.deepcopy(case.tools),
                chat_template=source,
                add_generation_prompt=case.add_generation_prompt,
                continue_final_message=case.continue_final_message,
                chat_template_kwargs=copy.deepcopy(case.chat_template_kwargs),
            )
        ),
        (vllm_sim_tokenization.PromptError,),
    )


def _family(name: str) -> str:
    lowered = name.lower()
    for key, family in (
        ("llama-3", "Llama 3.x"),
        ("qwen3.5", "Qwen3.5"),
        ("qwen3", "Qwen3"),
        ("qwen2.5", "Qwen2.5"),
        ("qwq", "Qwen2.5"),
        ("deepseek-v3.1", "DeepSeek V3.1"),
        ("deepseek", "DeepSeek (other)"),
        ("mistral", "Mistral (HF template)"),
        ("devstral", "Mistral (HF template)"),
        ("ministral", "Mistral (HF template)"),
    ):
        if key in lowered:
            return family
    return "other families"


def test_counts_match_the_engine_on_real_templates(
    templates: dict[str, str], vocabularies: dict[str, Vocabulary]
) -> None:
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    differences: list[str] = []
    compared = 0
    for name, source in templates.items():
        if name in NOT_HF_PATH:
            continue
        vocabulary = _vocabulary(vocabularies, vocabulary_for(name))
        family = _family(name)
        try:
            counter = _kvgate_counter(vocabulary, source)
        except ValueError as exc:
            # kvgate refuses to load what it cannot compile; the engine must fail it too.
            engine = _engine_count(vocabulary, source, CASES[0])
            assert isinstance(engine, str), f"{name}: kvgate cannot compile it ({exc})"
            rows[family]["templates that compile in neither"] += 1
            continue
        rows[family]["templates"] += 1
        for case in CASES:
            ours = _kvgate_count(counter, case)
            theirs = _engine_count(vocabulary, source, case)
            compared += 1
            rows[family]["cases"] += 1
            if isinstance(ours, int) and ours == theirs:
                rows[family]["equal counts"] += 1
            elif isinstance(ours, str) and isinstance(theirs, str):
                rows[family]["both refuse"] += 1
            else:
                rows[family]["differences"] += 1
                differences.append(f"{name} / {case.name}: kvgate {ours!r}, engine {theirs!r}")
    _write_report(rows, differences, compared)
    assert compared > 500, "too few templates compared to mean anything"
    assert not differences, "\n".join(differences)


def _write_report(rows: dict[str, dict[str, int]], differences: list[str], compared: int) -> None:
    columns = ["templates", "cases", "equal counts", "both refuse", "differences"]
    lines = [
        "# Hugging Face template parity (kvgate vs the simulator's vLLM 0.34 path)",
        "",
        f"{compared} template/case pairs; cases: {', '.join(c.name for c in CASES)}.",
        "",
        "| family | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for family in sorted(rows):
        lines.append(f"| {family} | " + " | ".join(str(rows[family][c]) for c in columns) + " |")
    lines += ["", "## Differences", "", *(f"- {d}" for d in differences or ["none"])]
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(lines) + "\n", encoding="utf-8")


# --- the simulator's request checks, as vLLM 0.34's request model makes them -------------


def test_simulator_reference_shares_no_code_with_kvgate() -> None:
    source = Path(vllm_sim_tokenization.__file__).read_text(encoding="utf-8")
    assert "from kvgate" not in source and "import kvgate" not in source


def test_simulator_carries_reasoning_effort_and_refuses_unknown_efforts() -> None:
    validation = pytest.importorskip("vllm_sim.validation")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat = validation.parse_chat({**body, "reasoning_effort": "xhigh"})
    assert chat.messages.reasoning_effort == "xhigh"
    assert chat.chat_template_kwargs is None  # the Mistral mode sees no kwargs sent
    with pytest.raises(validation.RequestError) as refused:
        validation.parse_chat({**body, "reasoning_effort": "extreme"})
    assert refused.value.status == 400 and "reasoning_effort" in str(refused.value.body)


def test_simulator_refuses_the_generation_prompt_combination_as_vllm_does() -> None:
    validation = pytest.importorskip("vllm_sim.validation")
    body = {"model": "m", "messages": [{"role": "assistant", "content": "Once"}]}
    # vLLM's validator reads the raw values: a truthy string counts as set.
    for prompt in (True, "false"):
        with pytest.raises(validation.RequestError, match="Cannot set both"):
            validation.parse_chat(
                {**body, "continue_final_message": True, "add_generation_prompt": prompt}
            )
    # Not sent, add_generation_prompt is True by default: the renderer refuses that later.
    chat = validation.parse_chat({**body, "continue_final_message": True})
    assert chat.add_generation_prompt and chat.continue_final_message


def test_text_part_extras_reach_a_template_that_prints_whole_parts(
    vocabularies: dict[str, Vocabulary],
) -> None:
    vocabulary = _vocabulary(vocabularies, "qwen2")
    source = (
        "{% for m in messages %}{% for p in m.content %}{{ p | tojson }}{% endfor %}{% endfor %}"
    )
    case = Case(
        "part-extras",
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
                    {"type": "input_text", "text": "there", "uuid": "u-1", "x-trace": [1, 2]},
                ],
            }
        ],
    )
    ours = _kvgate_count(_kvgate_counter(vocabulary, source), case)
    assert ours == _engine_count(vocabulary, source, case)
    plain = Case("plain-parts", [{"role": "user", "content": ["hi", "there"]}])
    assert isinstance(ours, int) and ours > _kvgate_count(
        _kvgate_counter(vocabulary, source), plain
    )
