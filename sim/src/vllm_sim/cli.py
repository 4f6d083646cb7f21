"""``vllm-sim``: run the simulator as a server."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from vllm_sim.chat_flags import CONTENT_FORMAT_OPTIONS, load_chat_template
from vllm_sim.config import SimConfig
from vllm_sim.server import create_app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-sim",
        description="A vLLM OpenAI-compatible server simulator with KV-cache accounting.",
    )
    p.add_argument(
        "--model-dir",
        required=True,
        type=Path,
        help="model dir: Hugging Face (tokenizer.json + tokenizer_config.json) or Mistral "
        "(tekken.json or tokenizer.model.v*)",
    )
    p.add_argument(
        "--tokenizer-mode",
        choices=["auto", "hf", "mistral"],
        default="auto",
        help="vLLM's --tokenizer-mode (auto: mistral for a Mistral-format dir)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients use (default: the model dir, as vLLM does)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV cache size in blocks (vLLM's --num-gpu-blocks-override)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--ttft-ms", type=float, default=0.0, help="prefill time per admission")
    p.add_argument("--itl-ms", type=float, default=0.0, help="time between output tokens")
    p.add_argument(
        "--default-output-tokens",
        type=int,
        default=16,
        help="tokens a request generates when no x-sim-output-tokens header is set",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--force-include-usage",
        action="store_true",
        help="always end streams with the usage chunk (vLLM's --enable-force-include-usage)",
    )
    p.add_argument(
        "--no-eos-token",
        action="store_true",
        help="a 'stop' finish shows all its tokens instead of ending on a hidden EOS",
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (else VLLM_API_KEY, as vLLM)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="most logprobs/top_logprobs a request may ask for (vLLM's default 20)",
    )
    p.add_argument(
        "--request-history",
        type=int,
        default=1000,
        help="how many /v1/* requests GET /sim/requests remembers",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="vLLM's automatic prefix caching: full KV blocks of equal prefixes are "
        "shared and kept, evictable, after their requests end (vLLM v1 defaults to on; "
        "the simulator to off)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage carries prompt_tokens_details.cached_tokens after a prefix-cache hit "
        "(as vLLM's flag)",
    )
    p.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=0.0,
        help="prefill time per 1,000 prompt tokens not found in the prefix cache, added "
        "to --ttft-ms",
    )
    p.add_argument(
        "--embedding-model",
        choices=["wordllama"],
        default=None,
        help="also serve POST /v1/embeddings with this real embedding model (WordLlama "
        "l2_supercat, 256 dimensions, from the wordllama wheel); a real vLLM serves "
        "either generation or embeddings, the simulator both",
    )
    p.add_argument(
        "--embedding-served-model-name",
        default="wordllama-l2-supercat",
        help="model id for /v1/embeddings (listed in /v1/models after the generation model)",
    )
    p.add_argument(
        "--embedding-max-model-len",
        type=int,
        default=8192,
        help="the embedding model's context length in tokens",
    )
    p.add_argument(
        "--score-template",
        default=None,
        help="also serve rerank and score (/rerank, /v1/rerank, /v2/rerank, /score, /v1/score) "
        "as a cross-encoder with this score template (a file path or the template), on the "
        "simulator's tokenizer",
    )
    p.add_argument(
        "--score-served-model-name",
        default="qwen3-reranker-demo",
        help="model id for rerank and score",
    )
    # vLLM 0.34's frontend flags that change a rendered chat (vllm_sim.chat_flags).
    p.add_argument(
        "--default-chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON object of keywords for the chat template, under each request's own "
        "(vLLM's --default-chat-template-kwargs), e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--reasoning-effort-map",
        type=json.loads,
        default=None,
        help="JSON object rewriting a request's reasoning_effort before the template (or "
        'harmony) sees it, e.g. \'{"medium": "low"}\' (vLLM\'s --reasoning-effort-map)',
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a chat template file, one of vLLM's bundled templates by name, or the "
        "template itself (any of '{', '}' or a newline in a value that is no file); it "
        "replaces the model directory's template (vLLM's --chat-template)",
    )
    p.add_argument(
        "--chat-template-content-format",
        choices=list(CONTENT_FORMAT_OPTIONS),
        default="auto",
        help="message content as text ('string') or as a list of parts ('openai'); 'auto' "
        "detects it from the template (vLLM's --chat-template-content-format)",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="a chat completion with tool_choice 'none' renders without its tools (vLLM's flag)",
    )
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model_dir=args.model_dir,
        tokenizer_mode=args.tokenizer_mode,
        served_model_name=args.served_model_name or str(args.model_dir),
        max_model_len=args.max_model_len,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        default_output_tokens=args.default_output_tokens,
        max_num_seqs=args.max_num_seqs,
        force_include_usage=args.force_include_usage,
        eos_on_stop=not args.no_eos_token,
        # vLLM: --api-key wins over VLLM_API_KEY; empty keys are dropped.
        api_keys=tuple(k for k in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if k),
        max_logprobs=args.max_logprobs,
        request_history=args.request_history,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
        embedding_model=args.embedding_model,
        embedding_served_model_name=args.embedding_served_model_name,
        embedding_max_model_len=args.embedding_max_model_len,
        score_template=load_chat_template(args.score_template),
        score_served_model_name=args.score_served_model_name,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        reasoning_effort_map=args.reasoning_effort_map,
        # vLLM's load_chat_template at start-up: a path is read, a template kept.
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"vllm-sim: {exc}") from exc
    app = create_app(config)
    logging.getLogger("vllm_sim").info(
        "serving %s from %s on http://%s:%d (KV %d blocks x %d tokens, prefix caching %s)",
        config.served_model_name,
        config.model_dir,
        args.host,
        args.port,
        config.gpu_blocks,
        config.block_size,
        "on" if config.enable_prefix_caching else "off",
    )
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
