"""What structured output enforces, as plain data the worker compiles with xgrammar.

- `response_format` json_schema / json_object (and the Responses API's `text.format`): the reply's
  content is one JSON value of that schema, compact (fixed separators, no free whitespace).
- `tool_choice` required or a named function: the reply is one DSML tool-call block whose invokes name
  the given tools and whose parameters follow each tool's `parameters` schema (xgrammar's
  `deepseek_xml` style: `<｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>`), the same
  text chat/tools.render_tool_calls writes and chat/parser.py reads.

Each function returns (kind, spec) with kind "json_schema" or "structural_tag" (ipc.sampling.StructuredOutput).
"""

from __future__ import annotations

import json
from typing import Any

from dsv4serve.chat import tokens as T
from dsv4serve.chat.messages import ChatFormatError

ANY_OBJECT_SCHEMA = {"type": "object"}
MAX_WHITESPACE = 2  # whitespace runs allowed around DSML parameters and inside JSON parameter values


def schema_constraint(schema: Any, where: str) -> tuple[str, str]:
    if not isinstance(schema, dict) and not isinstance(schema, bool):
        raise ChatFormatError(f"{where}: the schema must be a JSON object")
    return "json_schema", json.dumps(schema, ensure_ascii=False, sort_keys=False)


def response_format_constraint(response_format: Any, where: str = "response_format") -> tuple[str, str] | None:
    """Chat completions' `response_format`: None for text (or absent), else the JSON constraint."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ChatFormatError(f"{where}: must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_constraint(ANY_OBJECT_SCHEMA, where)
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise ChatFormatError(f'{where}: json_schema needs {{"json_schema": {{"name": ..., "schema": {{...}}}}}}')
        return schema_constraint(inner["schema"], f"{where}.json_schema.schema")
    raise ChatFormatError(f"{where}: type {kind!r} is not one of text, json_object, json_schema")


def _invoke_tag(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    return {
        "type": "tag",
        "begin": f'{T.INVOKE_START} name="{function["name"]}">\n',
        "content": {
            "type": "json_schema",
            "json_schema": parameters,
            "style": "deepseek_xml",
            "max_whitespace_cnt": MAX_WHITESPACE,
        },
        "end": f"{T.INVOKE_END}\n",
    }


def forced_call_constraint(
    functions: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None = None
) -> tuple[str, str] | None:
    """The DSML call block a reply must be when tool_choice is "required" (one or more calls of any of
    `functions`) or names a function (one call of it); None otherwise. `functions` are checked
    OpenAI function objects (chat.messages.check_functions)."""
    if tool_choice == "required":
        invokes: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": [_invoke_tag(f) for f in functions],
            "separator": "",
            "at_least_one": True,
            "stop_after_first": parallel_tool_calls is False,
        }
    elif isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        invokes = _invoke_tag(next(f for f in functions if f["name"] == name))
    else:
        return None
    block = {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": f"\n\n{T.TOOL_CALLS_START}\n"},
            invokes,
            {"type": "const_string", "value": T.TOOL_CALLS_END},
        ],
    }
    return "structural_tag", json.dumps({"type": "structural_tag", "format": block}, ensure_ascii=False)
