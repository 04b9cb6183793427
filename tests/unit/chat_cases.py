"""Chat messages and expected prompts shared by the prompt rendering tests (test_chat_render*.py).

CASE1..CASE4 are DeepSeek's golden test cases for `encoding/encoding_dsv4.py`, shipped with the
DeepSeek-V4-Flash checkpoint as `encoding/tests/test_input_N.json` / `test_output_N.txt` and run by
`encoding/test_encoding_dsv4.py` (read through the verbatim copy in GitHub
Mockingjay1316/deepseek-v4-flash-spark, commit ae059d9). Case 1 puts the request's tools on the
system message, exactly as `test_case_1` does; cases 1-3 are thinking mode, case 4 chat mode.
"""

from __future__ import annotations

import json

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


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def two_turns() -> list[dict]:
    return [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "reasoning_content": "ra"},
        {"role": "user", "content": "b"},
    ]
