"""DeepSeek-V4 chat layer: prompt rendering and the streaming reasoning / DSML tool-call parser."""

from dsv4serve.chat.messages import ChatFormatError
from dsv4serve.chat.parser import ParsedCompletion, ParserDelta, StreamParser, ToolCall, parse_completion
from dsv4serve.chat.render import prompt_opens_reasoning, render_prompt, resolve_thinking

__all__ = [
    "ChatFormatError",
    "ParsedCompletion",
    "ParserDelta",
    "StreamParser",
    "ToolCall",
    "parse_completion",
    "prompt_opens_reasoning",
    "render_prompt",
    "resolve_thinking",
]
