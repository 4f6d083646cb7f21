"""kvgate's counts for gpt-oss equal the engine's, on a hostile corpus.

vLLM renders a gpt-oss chat with the harmony library (oss-harmony, vocabulary embedded),
never with a chat template. The reference is the simulator's rendering (vllm_sim, written
from vLLM's harmony path independently of kvgate's counter); the model directory is built
at test time from the harmony encoding's own vocabulary.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from openai_harmony import (
    Conversation,
    HarmonyEncodingName,
    Message,
    Role,
    SystemContent,
    load_harmony_encoding,
)

from kvgate.tokenize import PromptCounter, PromptRenderError, detect_tokenizer_mode, load_counter
from kvgate.tokenize.counter import CountingApi
from kvgate.tokenize.harmony import HarmonyPromptCounter
from testbed.engine_models import gpt_oss_model_dir
from tests.tokenize.hostile_corpus import COMPLETION_PROMPTS, SPECIAL_TEXTS, ChatCase, chat_cases
from vllm_sim.engine_tokenizers import HarmonySimTokenizer
from vllm_sim.tokenization import PromptError

CASES = chat_cases()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return gpt_oss_model_dir()


@pytest.fixture(scope="module")
def counter(model_dir: Path) -> CountingApi:
    return load_counter(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> HarmonySimTokenizer:
    return HarmonySimTokenizer(model_dir)


def engine_count(engine: HarmonySimTokenizer, case: ChatCase) -> int:
    return len(
        engine.encode_chat(
            case.messages,
            tools=case.tools,
            add_generation_prompt=case.add_generation_prompt,
            continue_final_message=case.continue_final_message,
        )
    )


def kvgate_count(counter: CountingApi, case: ChatCase) -> int:
    return counter.count_chat(
        case.messages,
        case.tools,
        add_generation_prompt=case.add_generation_prompt,
        continue_final_message=case.continue_final_message,
    )


def test_auto_picks_harmony_for_a_gpt_oss_dir(model_dir: Path, counter: CountingApi) -> None:
    assert detect_tokenizer_mode(model_dir) == "harmony"
    assert isinstance(counter, HarmonyPromptCounter)


def test_hostile_chat_corpus_counts_like_the_engine(
    counter: CountingApi, engine: HarmonySimTokenizer
) -> None:
    rows = [(case.name, kvgate_count(counter, case), engine_count(engine, case)) for case in CASES]
    differing = [row for row in rows if row[1] != row[2]]
    assert not differing, "kvgate vs engine:\n" + "\n".join(map(str, differing))
    assert {case.family for case in CASES if case.family} == set(SPECIAL_TEXTS)


def test_reasoning_and_tool_history_count_like_the_engine(
    counter: CountingApi, engine: HarmonySimTokenizer
) -> None:
    """Reasoning before the last final answer is dropped, prior tool calls take the older
    header layout: both change the count, both as the engine does."""
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be <|channel|> brief."}]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "reasoning": "think <|message|> hard", "content": "Sunny."},
        {"role": "user", "content": "and in Rome?"},
        {
            "role": "assistant",
            "reasoning_content": "need the tool <|call|>",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "<|end|>"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "rain"}]},
        {"role": "system", "content": "Answer in one word <|return|>"},
    ]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    case = ChatCase("history", messages, tools)
    assert kvgate_count(counter, case) == engine_count(engine, case)
    ids = counter.encode_chat(messages, tools)  # type: ignore[attr-defined]
    text = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).decode(ids)
    assert "assistant to=functions.get<|channel|>commentary json<|message|>" in text
    assert "think <|message|> hard" not in text  # superseded by the final "Sunny."


def test_special_text_in_a_tool_call_header_is_refused_like_the_engine(
    counter: CountingApi, engine: HarmonySimTokenizer
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get<|end|>", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    with pytest.raises(PromptRenderError):
        counter.count_chat(messages)
    with pytest.raises(PromptError):
        engine.encode_chat(messages)


def test_the_flood_counts_at_the_engines_count(counter: CountingApi) -> None:
    """26k characters of <|endoftext|> in a user message are text to harmony: ~12k tokens."""
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    flood = "<|endoftext|>" * 2000
    system = SystemContent.new().with_conversation_start_date("2026-12-04")
    reference = encoding.render_conversation_for_completion(
        Conversation.from_messages(
            [
                Message.from_role_and_content(Role.SYSTEM, system),
                Message.from_role_and_content(Role.USER, flood),
            ]
        ),
        Role.ASSISTANT,
    )
    got = counter.count_chat([{"role": "user", "content": flood}])
    assert got == len(reference) > 12_000


@pytest.mark.parametrize("prompt", COMPLETION_PROMPTS, ids=range(len(COMPLETION_PROMPTS)))
def test_completions_and_output_count_like_the_engine(
    counter: CountingApi, engine: HarmonySimTokenizer, prompt: str
) -> None:
    """Completions take the Hugging Face tokenizer (special tokens match, as in vLLM);
    output text is plain text."""
    assert counter.count_completion(prompt) == len(engine.encode(prompt, add_special_tokens=True))
    assert counter.count_text(prompt) == engine.count_text(prompt)


def test_counting_cost_against_the_hf_path(counter: CountingApi, model_dir: Path) -> None:
    """The harmony render of a 52k-character chat, and the same text on the HF path."""
    case = next(c for c in CASES if c.name == "50k hostile")
    started = time.perf_counter()
    counter.count_chat(case.messages)
    harmony_s = time.perf_counter() - started
    hf = PromptCounter.from_model_dir(model_dir)
    text = "".join(str(m["content"]) for m in case.messages)
    started = time.perf_counter()
    hf.count_text(text)
    hf_s = time.perf_counter() - started
    print(f"harmony chat {harmony_s * 1000:.1f} ms, hf text {hf_s * 1000:.1f} ms")
    assert harmony_s < 1.0


def test_instructions_in_the_system_message_count_like_the_engine(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM with VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS=1 puts instructions in the system
    message, and renders a later system message as a whole system message (longer)."""
    monkeypatch.setenv("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS", "1")
    engine = HarmonySimTokenizer(model_dir)
    counter = load_counter(model_dir, harmony_system_instructions=True)
    default = load_counter(model_dir)
    cases = [c for c in CASES if c.messages[0]["role"] == "system"] + [
        ChatCase(
            "later system and developer",
            [
                {"role": "system", "content": "Lead <|start|>"},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "Be brief <|end|>"},
                {"role": "developer", "content": "dev note"},
                {"role": "user", "content": "again"},
            ],
            tools=[{"type": "function", "function": {"name": "noop"}}],
        )
    ]
    for case in cases:
        assert kvgate_count(counter, case) == engine_count(engine, case), case.name
    assert kvgate_count(counter, cases[-1]) > kvgate_count(default, cases[-1])
