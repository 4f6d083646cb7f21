"""Rerank and score bodies: vLLM's pairing rules, the hostile bodies refused, and each
pair counted as vLLM renders it for a cross-encoder served with a score template (the
query and document messages through the template, no generation prompt, the tokenizer's
special tokens): the same text the transformers renderer vLLM calls produces."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tokenizers import Tokenizer

from kvgate.capacity.registry import CapacityRegistry
from kvgate.config import SnapshotHolder, compile_snapshot, hash_api_key, parse_config
from kvgate.lifecycle import Admission, Rejected
from kvgate.lifecycle.protocol import ClientError
from kvgate.policy import Reason
from kvgate.pooling import MAX_INPUTS
from kvgate.protocols import METERED_APIS
from kvgate.store import MemoryStore
from kvgate.tokenize import PromptCounter, TokenizerService
from kvgate.tokenize.engine_flags import EngineFlags
from testbed.demo_model import demo_model_dir
from testbed.reranker_model import TEMPLATE

RERANKER = "reranker"
PLAIN = "plain"  # a model without a score template
MAX_CONTEXT = 512


def body(**fields: Any) -> bytes:
    return json.dumps({"model": RERANKER, **fields}).encode()


def parse(path: str, raw: bytes) -> Any:
    return METERED_APIS[path].parse(raw)


def refusal(path: str, raw: bytes) -> tuple[int, str | None]:
    with pytest.raises(ClientError) as refused:
        parse(path, raw)
    answer = json.loads(refused.value.answer.to_body())["error"]
    return refused.value.answer.status, answer["param"]


def test_every_path_is_metered() -> None:
    for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score"):
        assert path in METERED_APIS


def test_rerank_pairs_the_query_with_each_document() -> None:
    request = parse("/v1/rerank", body(query="q", documents=["a", "b"], top_n=1))
    assert request.score_pairs == [("q", "a"), ("q", "b")]
    assert request.kind == "pooling" and not request.generates
    assert request.num_prompts == 2 and request.prompt_param == "documents"


@pytest.mark.parametrize(
    ("fields", "pairs"),
    [
        ({"text_1": "q", "text_2": "d"}, [("q", "d")]),
        ({"text_1": "q", "text_2": ["a", "b"]}, [("q", "a"), ("q", "b")]),
        ({"text_1": ["q1", "q2"], "text_2": ["a", "b"]}, [("q1", "a"), ("q2", "b")]),
        ({"queries": ["q"], "documents": ["a"]}, [("q", "a")]),
        ({"queries": "q", "items": ["a"]}, [("q", "a")]),
        ({"data_1": "q", "data_2": "a"}, [("q", "a")]),
    ],
)
def test_score_broadcasting(fields: dict[str, Any], pairs: list[tuple[str, str]]) -> None:
    assert parse("/score", body(**fields)).score_pairs == pairs


def test_instruction_is_folded_into_the_template_keywords() -> None:
    request = parse("/rerank", body(query="q", documents="d", instruction="Find"))
    assert request.chat_template_kwargs == {"instruction": "Find"}
    explicit = body(
        query="q", documents="d", instruction="Find", chat_template_kwargs={"instruction": "Own"}
    )
    assert parse("/rerank", explicit).chat_template_kwargs == {"instruction": "Own"}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/rerank", {"documents": ["a"]}, "query"),
        ("/rerank", {"query": "q"}, "documents"),
        ("/rerank", {"query": ["q"], "documents": ["a"]}, "query"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/rerank", {"query": "q", "documents": ["a", 3]}, "documents[1]"),
        ("/rerank", {"query": "q", "documents": [["a"]]}, "documents[0]"),
        ("/rerank", {"query": "q", "documents": ["a"] * (MAX_INPUTS + 1)}, "documents"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": "3"}, "top_n"),
        ("/rerank", {"query": {"content": []}, "documents": ["a"]}, "query"),
        ("/rerank", {"query": "q", "documents": [{"content": []}]}, "documents[0]"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_1"),
        ("/score", {"text_1": [], "text_2": ["x"]}, "text_1"),
        ("/score", {"text_1": "a"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": -5}, None),
        ("/score", {"text_1": "a", "text_2": "b", "chat_template_kwargs": []}, None),
        ("/score", {"text_1": "a", "text_2": "b", "chat_template_kwargs": {"tools": 1}}, None),
        ("/score", {"text_1": "a", "text_2": "b", "instruction": 5}, "instruction"),
        ("/score", {"text_1": "a", "text_2": "b", "max_tokens_per_doc": -1}, None),
    ],
)
def test_hostile_bodies_are_refused(path: str, fields: dict[str, Any], param: str | None) -> None:
    status, named = refusal(path, body(**fields))
    assert status == 400
    expected = param or next(k for k in fields if k not in ("text_1", "text_2"))
    assert named == expected


# --------------------------------------------------------------------------- counting


def rendered(query: str, document: str, **kwargs: Any) -> int:
    """vLLM's rendering: safe_apply_chat_template(tokenize=False) is transformers' jinja
    renderer over the two messages; then tokenizer(text) with special tokens."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    text = _compile_jinja_template(TEMPLATE).render(messages=messages, **kwargs)
    tokenizer = Tokenizer.from_file(str(demo_model_dir() / "tokenizer.json"))
    return len(tokenizer.encode(text, add_special_tokens=True).ids)


def _model(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "tokenizer": str(demo_model_dir()),
        "max_context": MAX_CONTEXT,
        "default_max_new_tokens": 16,
        "backend": "gpu",
        "pricing": {"input_per_million": "1"},
    }


@pytest.fixture
async def admission() -> AsyncIterator[Admission]:
    config = {
        "tenants": [{"name": "acme", "api_key_sha256": hash_api_key("k")}],
        "models": [_model(RERANKER), _model(PLAIN)],
        "backends": [{"name": "gpu", "kv_budget_tokens": 100_000, "kv_block_size": 16}],
    }
    snapshots = SnapshotHolder(compile_snapshot(parse_config(config)))
    tokenizers = TokenizerService(max_workers=1)
    flags = EngineFlags(chat_template=TEMPLATE)
    tokenizers.register(
        RERANKER, PromptCounter.from_model_dir(demo_model_dir(), name=RERANKER, engine_flags=flags)
    )
    tokenizers.register(PLAIN, PromptCounter.from_model_dir(demo_model_dir(), name=PLAIN))
    yield Admission(
        snapshot=snapshots.current,
        store=MemoryStore(lease_ttl_s=60),
        tokenizers=tokenizers,
        capacity=CapacityRegistry(),
        record_violations=lambda _tenant, _decision: None,
        track=lambda _coro: None,
    )
    tokenizers.close()


async def admit(admission: Admission, path: str, raw: bytes) -> Any:
    policy = admission._snapshot.tenants["acme"]
    return await admission.admit(parse(path, raw), policy, "r", "r/x")


QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow, {{ not jinja }}.", "ok"]


async def test_each_pair_is_counted_as_vllm_renders_it(admission: Admission) -> None:
    ticket = await admit(admission, "/rerank", body(query=QUERY, documents=DOCS))
    assert ticket.prompt_tokens == sum(rendered(QUERY, doc) for doc in DOCS)
    assert ticket.max_new_tokens == 0


async def test_the_instruction_is_rendered(admission: Admission) -> None:
    raw = body(text_1=QUERY, text_2=DOCS[0], instruction="Find the capital")
    ticket = await admit(admission, "/score", raw)
    assert ticket.prompt_tokens == rendered(QUERY, DOCS[0], instruction="Find the capital")
    assert ticket.prompt_tokens != rendered(QUERY, DOCS[0])


async def test_truncation_and_the_context(admission: Admission) -> None:
    long_doc = "word " * 1000
    ticket = await admit(
        admission, "/score", body(text_1="q", text_2=[long_doc, "d"], truncate_prompt_tokens=40)
    )
    assert ticket.prompt_tokens == 40 + min(40, rendered("q", "d"))
    with pytest.raises(Rejected) as refused:
        await admit(admission, "/rerank", body(query="q", documents=["d", long_doc]))
    rejection = refused.value.rejection
    assert rejection.reason is Reason.CONTEXT_LENGTH_EXCEEDED
    assert rejection.param == "documents"


async def test_a_model_without_a_score_template_is_refused(admission: Admission) -> None:
    raw = json.dumps({"model": PLAIN, "query": "q", "documents": ["d"]}).encode()
    with pytest.raises(Rejected) as refused:
        await admit(admission, "/rerank", raw)
    assert refused.value.rejection.reason is Reason.UNRENDERABLE_PROMPT
    assert "score template" in refused.value.rejection.message
