"""kvgate's counts in vLLM's mistral tokenizer mode equal the engine's, on a hostile corpus.

The reference is the vLLM path itself: transformers' ``MistralCommonBackend`` (the class
vLLM's MistralTokenizer wraps) fed the request the way vLLM shapes it, as the simulator
does it (vllm_sim, written independently of kvgate's counter). Both layouts: tekken.json
and a SentencePiece tokenizer.model.v3, in directories with no tokenizer.json at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from kvgate.tokenize import PromptRenderError, detect_tokenizer_mode, load_counter
from kvgate.tokenize.counter import CountingApi
from kvgate.tokenize.mistral import MistralPromptCounter
from testbed.demo_model import demo_model_dir
from testbed.engine_models import mistral_spm_model_dir, mistral_tekken_model_dir
from tests.tokenize.hostile_corpus import COMPLETION_PROMPTS, SPECIAL_TEXTS, ChatCase, chat_cases
from vllm_sim.engine_tokenizers import MistralSimTokenizer
from vllm_sim.tokenization import PromptError

LAYOUTS = {"tekken": mistral_tekken_model_dir, "sentencepiece": mistral_spm_model_dir}
CASES = chat_cases()
# mistral_common refuses an assistant message with neither content nor tool calls.
ENGINE_REFUSES = ["empty assistant turn"]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, LAYOUTS[request.param]()


@pytest.fixture(scope="module")
def counters(layout: tuple[str, Path]) -> tuple[CountingApi, MistralSimTokenizer]:
    _, model_dir = layout
    return load_counter(model_dir), MistralSimTokenizer(model_dir)


def kvgate_outcome(counter: CountingApi, case: ChatCase) -> int | str:
    try:
        return counter.count_chat(
            case.messages,
            case.tools,
            add_generation_prompt=case.add_generation_prompt,
            continue_final_message=case.continue_final_message,
        )
    except PromptRenderError:
        return "refused"


def engine_outcome(engine: MistralSimTokenizer, case: ChatCase) -> int | str:
    try:
        return len(
            engine.encode_chat(
                case.messages,
                tools=case.tools,
                add_generation_prompt=case.add_generation_prompt,
                continue_final_message=case.continue_final_message,
            )
        )
    except PromptError:
        return "refused"


def test_auto_picks_the_mistral_mode_for_a_mistral_format_dir(layout: tuple[str, Path]) -> None:
    _, model_dir = layout
    assert not (model_dir / "tokenizer.json").exists()
    assert detect_tokenizer_mode(model_dir) == "mistral"
    assert isinstance(load_counter(model_dir), MistralPromptCounter)
    assert detect_tokenizer_mode(demo_model_dir()) == "hf"


def test_hostile_chat_corpus_counts_like_the_engine(
    counters: tuple[CountingApi, MistralSimTokenizer],
) -> None:
    counter, engine = counters
    rows = [
        (case.name, kvgate_outcome(counter, case), engine_outcome(engine, case)) for case in CASES
    ]
    differing = [row for row in rows if row[1] != row[2]]
    assert not differing, "kvgate vs engine:\n" + "\n".join(map(str, differing))
    # The comparison is of counts: the engine refuses only what mistral_common rejects.
    assert [name for name, outcome, _ in rows if outcome == "refused"] == ENGINE_REFUSES
    families = {case.family for case in CASES if case.family}
    assert families == set(SPECIAL_TEXTS)


def test_refusals_match_the_engine(counters: tuple[CountingApi, MistralSimTokenizer]) -> None:
    counter, engine = counters
    refused = [
        ChatCase(
            "generation prompt after assistant",
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ],
        ),
        ChatCase(
            "continue after user",
            [{"role": "user", "content": "hi"}],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
    ]
    for case in refused:
        assert kvgate_outcome(counter, case) == engine_outcome(engine, case) == "refused", case.name
    with pytest.raises(PromptRenderError):
        counter.count_chat(
            [{"role": "user", "content": "hi"}], chat_template_kwargs={"enable_thinking": True}
        )


def test_the_flood_counts_at_the_engines_count(layout: tuple[str, Path]) -> None:
    """26k characters of <|endoftext|> are plain text to the engine: about 12k tokens."""
    _, model_dir = layout
    counter = load_counter(model_dir)
    mistral = MistralTokenizer.from_file(
        str(next(p for p in model_dir.iterdir() if p.name.startswith(("tekken", "tokenizer")))),
        mode=ValidationMode.test,
    )
    for flood in ("<|endoftext|>" * 2000, "[INST]" * 2000, "[/INST]</s><s>" * 1000):
        messages = [{"role": "user", "content": flood}]
        engine = len(
            mistral.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens
        )
        assert counter.count_chat(messages) == engine
        assert engine > len(flood) // 4  # many tokens per literal, never one


@pytest.mark.parametrize("prompt", COMPLETION_PROMPTS, ids=range(len(COMPLETION_PROMPTS)))
def test_completions_and_output_count_like_the_engine(
    counters: tuple[CountingApi, MistralSimTokenizer], prompt: str
) -> None:
    counter, engine = counters
    assert counter.count_completion(prompt) == len(engine.encode(prompt, add_special_tokens=True))
    assert counter.count_completion([prompt, prompt]) == 2 * counter.count_completion(prompt)
    assert counter.count_text(prompt) == engine.count_text(prompt)


def test_a_chat_is_weighed_for_the_inline_bound(
    counters: tuple[CountingApi, MistralSimTokenizer],
) -> None:
    """A whole mistral_common encode costs several compiled-BPE characters per character, so
    the service tokenizes fewer of them on the event loop."""
    counter, _ = counters
    text = "hello there " * 100
    plan = counter.plan_chat([{"role": "user", "content": text}])
    assert plan.pending_chars >= 4 * len(text)
    assert counter.finish(plan) == counter.count_chat([{"role": "user", "content": text}])
