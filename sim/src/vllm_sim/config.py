"""Configuration of the vLLM simulator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_sim.chat_flags import ChatFlags, validate_reasoning_effort_map

# The vLLM release whose OpenAI-server wire format the simulator reproduces.
VLLM_VERSION = "0.10.2"

# Without --num-gpu-blocks a real vLLM profiles GPU memory; we pick a fixed, roomy
# figure instead (about what a Qwen2-7B in bf16 gets on an 80 GB card).
DEFAULT_NUM_GPU_BLOCKS = 65536


@dataclass(frozen=True)
class SimConfig:
    """Everything that shapes one simulated vLLM server.

    ``num_gpu_blocks * block_size`` is the KV capacity in tokens. A real vLLM refuses to
    start when that is below ``max_model_len``; the simulator instead lowers its
    effective context length to the capacity (see :attr:`effective_max_model_len`) so
    that tiny caches, useful for preemption tests, still serve every admitted request.
    """

    model_dir: Path
    served_model_name: str
    # vLLM's --tokenizer-mode: "auto" picks from the model dir as vLLM does (gpt-oss ->
    # harmony, a Mistral-format dir -> mistral, else hf).
    tokenizer_mode: str = "auto"
    max_model_len: int = 32768
    num_gpu_blocks: int | None = None
    block_size: int = 16
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    default_output_tokens: int = 16
    max_num_seqs: int = 256
    force_include_usage: bool = False
    # A "stop" finish ends on the EOS token, counted in completion_tokens but not
    # shown, as a real model does. False makes every generated token visible text.
    eos_on_stop: bool = True
    # How many finished requests /sim/stats remembers.
    served_history: int = 1000
    # vLLM's --api-key (or VLLM_API_KEY): when set, /v1/* needs "Bearer <one of them>".
    api_keys: tuple[str, ...] = ()
    # vLLM's --max-logprobs: the most (top_)logprobs a request may ask for.
    max_logprobs: int = 20
    # How many arriving /v1/* requests /sim/requests remembers.
    request_history: int = 1000
    # vLLM's --enable-prefix-caching. vLLM v1 turns it on by default; the simulator
    # keeps it off by default because existing tests count KV blocks without sharing.
    enable_prefix_caching: bool = False
    # vLLM's --enable-prompt-tokens-details: usage carries
    # prompt_tokens_details.cached_tokens when a request hit the prefix cache.
    enable_prompt_tokens_details: bool = False
    # Prefill cost per 1,000 tokens a prefill computes (those not found in the prefix
    # cache), added to the TTFT; 0 keeps the TTFT flat.
    prefill_ms_per_1k_tokens: float = 0.0
    # POST /v1/embeddings backed by this embedding model ("wordllama"), served as
    # embedding_served_model_name next to the generation model (a real vLLM serves one
    # model: generation or pooling). None: /v1/embeddings answers as vLLM does for a
    # generation model ("The model does not support Embeddings API").
    embedding_model: str | None = None
    embedding_served_model_name: str = "wordllama-l2-supercat"
    embedding_max_model_len: int = 8192
    # POST /rerank, /v1/rerank, /v2/rerank, /score, /v1/score for a cross-encoder served with
    # this score template (vLLM's --chat-template on a reranker), named
    # score_served_model_name, on the simulator's tokenizer (vllm_sim.scoring). None: those
    # paths answer as vLLM does for a model without the Score API.
    score_template: str | None = None
    score_served_model_name: str = "qwen3-reranker-demo"
    # vLLM's chat-rendering flags (see vllm_sim.chat_flags): --default-chat-template-kwargs,
    # --reasoning-effort-map, --chat-template (the template's text: the CLI reads a path as
    # vLLM does), --chat-template-content-format, --exclude-tools-when-tool-choice-none.
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    reasoning_effort_map: Mapping[str, str] | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.default_output_tokens < 1:
            raise ValueError("default_output_tokens must be >= 1")
        if self.ttft_ms < 0 or self.itl_ms < 0 or self.prefill_ms_per_1k_tokens < 0:
            raise ValueError("latencies must be >= 0")
        if self.max_logprobs < -1:
            raise ValueError("max_logprobs must be >= -1")
        if self.request_history < 1:
            raise ValueError("request_history must be >= 1")
        if self.embedding_model is not None and self.embedding_model != "wordllama":
            raise ValueError(f"unknown embedding model {self.embedding_model!r} (known: wordllama)")
        if self.embedding_max_model_len < 1:
            raise ValueError("embedding_max_model_len must be >= 1")
        kwargs = self.default_chat_template_kwargs
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValueError("--default-chat-template-kwargs must be a JSON object")
        effort_map = self.reasoning_effort_map
        validate_reasoning_effort_map(
            dict(effort_map) if isinstance(effort_map, Mapping) else effort_map
        )
        self.chat_flags  # noqa: B018 (checks the content format)

    @property
    def chat_flags(self) -> ChatFlags:
        """The settings every chat is rendered with, on every route that renders one."""
        return ChatFlags(
            default_chat_template_kwargs=dict(self.default_chat_template_kwargs or {}),
            reasoning_effort_map=dict(self.reasoning_effort_map or {}),
            chat_template=self.chat_template,
            chat_template_content_format=self.chat_template_content_format,  # type: ignore[arg-type]
            exclude_tools_when_tool_choice_none=self.exclude_tools_when_tool_choice_none,
        )

    @property
    def gpu_blocks(self) -> int:
        return self.num_gpu_blocks if self.num_gpu_blocks is not None else DEFAULT_NUM_GPU_BLOCKS

    @property
    def kv_capacity_tokens(self) -> int:
        return self.gpu_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        # Why: guarantees any single admitted request fits the cache on its own, so
        # the FIFO scheduler can never wedge behind a request that cannot run.
        return min(self.max_model_len, self.kv_capacity_tokens)
