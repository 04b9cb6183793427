"""DSML: the tool section of the system prompt, and tool calls written and read in DSML.

Byte-exactness matters here: the tool section is the text the model was trained on, and earlier
assistant tool calls must re-render exactly as the model produced them for the prompt of the next
turn to share a cached prefix with the previous one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dsv4serve.chat import tokens as T


def to_json(value: Any) -> str:
    """JSON the way DeepSeek's encoder writes it: `", "` / `": "` separators, non-ASCII kept."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # e.g. lone surrogates: fall back to escapes
        return json.dumps(value, ensure_ascii=True)


def _tools_template() -> str:
    d = T.DSML
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools "
        f'by writing a "<{d}tool_calls>" block like the following:\n\n'
        f"<{d}tool_calls>\n"
        f'<{d}invoke name="$TOOL_NAME">\n'
        f'<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n'
        "...\n"
        f"</{d}invoke>\n"
        f'<{d}invoke name="$TOOL_NAME2">\n'
        "...\n"
        f"</{d}invoke>\n"
        f"</{d}tool_calls>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types '
        "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
        '`string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {T.THINK_START}), you MUST output your complete "
        f"reasoning inside {T.THINK_START}...{T.THINK_END} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {T.THINK_END} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        "{schemas}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
        "calls.\n"
    )


TOOLS_SECTION_TEMPLATE = _tools_template()


def render_tools_section(functions: list[dict[str, Any]]) -> str:
    """The "## Tools" section; `functions` are the `function` objects of OpenAI tools, in order."""
    schemas = "\n".join(to_json(f) for f in functions)
    return TOOLS_SECTION_TEMPLATE.replace("{schemas}", schemas)


def render_response_format_section(response_format: Any) -> str:
    return "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" + to_json(
        response_format
    )


def _render_parameter(name: str, value: Any) -> str:
    is_str = isinstance(value, str)
    text = value if is_str else to_json(value)
    flag = "true" if is_str else "false"
    return f'<{T.DSML}parameter name="{name}" string="{flag}">{text}{T.PARAMETER_END}'


def render_tool_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """An assistant turn's tool calls as DSML, with the blank line that separates them from the
    content. `calls` holds (name, decoded arguments object) pairs in call order."""
    invokes = []
    for name, arguments in calls:
        params = "\n".join(_render_parameter(k, v) for k, v in arguments.items())
        invokes.append(f'<{T.DSML}invoke name="{name}">\n{params}\n{T.INVOKE_END}')
    return f"\n\n{T.TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{T.TOOL_CALLS_END}"


def forced_call_opening(tool_choice: Any) -> str | None:
    """What a reply must go on with when tool_choice demands a call: for "required" the call block and
    an invoke whose function the model names; for a named function the whole invoke opening. None for
    "auto" / "none" / absent. The same text render_tool_calls writes, so the parser reads it as a call."""
    if tool_choice == "required":
        return f'\n\n{T.TOOL_CALLS_START}\n{T.INVOKE_START} name="'
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return f'\n\n{T.TOOL_CALLS_START}\n{T.INVOKE_START} name="{name}">\n'
    return None


# --- reading DSML the model wrote -------------------------------------------------------------

_INVOKE_RE = re.compile(re.escape(T.INVOKE_START) + r'\s+name="([^"]*)"\s*>')
_PARAM_RE = re.compile(
    re.escape(T.PARAMETER_START)
    + r'\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)'
    + re.escape(T.PARAMETER_END),
    re.DOTALL,
)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value_text(raw: str) -> str | None:
    """`raw` as a JSON value to insert verbatim, or None when it is not valid (strict) JSON."""
    try:
        json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return None
    return raw


def build_arguments(params: list[tuple[str, str, bool]]) -> str:
    """The arguments JSON object from DSML parameters (name, raw value, string flag), in order.

    string="true" values are JSON-string-encoded; string="false" values are JSON already and go in
    verbatim, unless they do not parse, in which case they are kept as a string rather than
    producing invalid JSON. A repeated name keeps its first position and its last value.
    """
    members: dict[str, str] = {}
    for name, raw, is_string in params:
        value = None if is_string else _json_value_text(raw)
        members[name] = to_json(raw) if value is None else value
    return "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in members.items()) + "}"


def parse_invoke(segment: str) -> tuple[str, str] | None:
    """(name, arguments JSON) from the text of one `<｜DSML｜invoke ...>...</｜DSML｜invoke>`, or None
    when it holds no well-formed invoke header."""
    head = _INVOKE_RE.search(segment)
    if head is None:
        return None
    body = segment[head.end() :]
    params = [(m.group(1), m.group(3), m.group(2) != "false") for m in _PARAM_RE.finditer(body)]
    return head.group(1), build_arguments(params)
