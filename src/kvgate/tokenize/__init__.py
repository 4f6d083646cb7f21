"""Counting prompt tokens exactly as the serving engine (vLLM) does, off the event loop."""

from kvgate.tokenize.chat_template import ChatTemplate, ContentFormat, detect_content_format
from kvgate.tokenize.counter import CountingApi, PromptCounter
from kvgate.tokenize.errors import PromptRenderError, TokenizerLoadError
from kvgate.tokenize.loader import resolve_tokenizer_dir
from kvgate.tokenize.messages import normalize_tools, parse_messages
from kvgate.tokenize.modes import TokenizerMode, detect_tokenizer_mode, load_counter
from kvgate.tokenize.segments import CacheStats
from kvgate.tokenize.service import TokenizerBusy, TokenizerService

__all__ = [
    "CacheStats",
    "ChatTemplate",
    "ContentFormat",
    "CountingApi",
    "PromptCounter",
    "PromptRenderError",
    "TokenizerBusy",
    "TokenizerLoadError",
    "TokenizerMode",
    "TokenizerService",
    "detect_content_format",
    "detect_tokenizer_mode",
    "load_counter",
    "normalize_tools",
    "parse_messages",
    "resolve_tokenizer_dir",
]
