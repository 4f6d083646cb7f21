"""Counting prompt tokens exactly as the serving engine (vLLM) does, off the event loop."""

from kvgate.tokenize.chat_template import ChatTemplate, ContentFormat, detect_content_format
from kvgate.tokenize.counter import PromptCounter
from kvgate.tokenize.errors import PromptRenderError, TokenizerLoadError
from kvgate.tokenize.loader import resolve_tokenizer_dir
from kvgate.tokenize.messages import normalize_tools, parse_messages
from kvgate.tokenize.service import CacheStats, TokenizerBusy, TokenizerService

__all__ = [
    "CacheStats",
    "ChatTemplate",
    "ContentFormat",
    "PromptCounter",
    "PromptRenderError",
    "TokenizerBusy",
    "TokenizerLoadError",
    "TokenizerService",
    "detect_content_format",
    "normalize_tools",
    "parse_messages",
    "resolve_tokenizer_dir",
]
