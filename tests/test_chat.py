"""Chat templates: rendered text equals transformers' apply_chat_template on the same string."""
import dataclasses
import logging
import os
from datetime import datetime

import pytest

from kestreld.engine.prompt import ChatInput, PromptBuilder
from kestreld.text.chat import CHATML_TEMPLATE, ChatTemplate
from kestreld.text.tools import ToolUse
from kestreld.model.gguf_file import open_gguf
from kestreld.errors import BadRequest
from _loader_models import smollm2_gguf

# Qwen3's generation prompt: with enable_thinking off, an empty thinking block is closed.
GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# A Qwen3-style template written for this test: ChatML turns, earlier reasoning stripped from
# assistant turns, tool results as JSON, unknown roles refused, and the enable_thinking switch
# that closes an empty <think> block when thinking is off.
QWEN3_STYLE = """
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + {'result': message.content} | tojson }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
    {%- if loop.index > 50 %}{% break %}{% endif %}
{%- endfor %}
""" + GENERATION_PROMPT

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "Und auf Deutsch? 你好 🙂"}],
    [{"role": "user", "content": "weather?"},
     {"role": "tool", "content": "sunny, 23 °C <b>"},
     {"role": "user", "content": "  spaced \n\n lines  "}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()),
                                                bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def smollm2_template():
    return open_gguf(smollm2_gguf()).fields["tokenizer.chat_template"].contents()


def _reference(tok, template, messages, **kw):
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("gen", [True, False])
def test_qwen3_style_equals_transformers(hf_tokenizer, thinking, gen):
    t = ChatTemplate(QWEN3_STYLE)
    for msgs in CONVERSATIONS:
        ours = t.render(msgs, add_generation_prompt=gen, enable_thinking=thinking,
                        bos_token="<s>", eos_token="</s>")
        assert ours == _reference(hf_tokenizer, QWEN3_STYLE, msgs, add_generation_prompt=gen,
                                  enable_thinking=thinking)


def test_qwen3_style_thinking_switch():
    t = ChatTemplate(QWEN3_STYLE)
    msgs = CONVERSATIONS[0]
    assert t.render(msgs).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert t.render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    # earlier reasoning is dropped, tojson keeps non-ASCII and does not escape HTML
    text = t.render(CONVERSATIONS[1] + CONVERSATIONS[2][1:2])
    assert "add" not in text and "<|im_start|>assistant\n4<|im_end|>" in text
    assert '{"result": "sunny, 23 °C <b>"}' in text


def test_smollm2_template_equals_transformers(hf_tokenizer, smollm2_template):
    t = ChatTemplate(smollm2_template)
    for msgs in CONVERSATIONS[:2]:
        for gen in (True, False):
            ours = t.render(msgs, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>")
            assert ours == _reference(hf_tokenizer, smollm2_template, msgs, add_generation_prompt=gen)
    text = t.render(CONVERSATIONS[0])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_missing_template_falls_back_to_chatml_with_a_warning(caplog, hf_tokenizer):
    with caplog.at_level(logging.WARNING, logger="kestreld.text.chat"):
        t = ChatTemplate(None)
    assert "no chat template" in caplog.text and "ChatML" in caplog.text
    msgs = CONVERSATIONS[1]
    assert t.render(msgs) == _reference(hf_tokenizer, CHATML_TEMPLATE, msgs, add_generation_prompt=True)
    assert t.render(msgs).startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_template_errors_are_bad_requests():
    t = ChatTemplate(QWEN3_STYLE)
    with pytest.raises(BadRequest, match="Unknown role: robot"):
        t.render([{"role": "robot", "content": "beep"}])
    with pytest.raises(BadRequest, match="chat template"):
        ChatTemplate("{% for x in %}")
    with pytest.raises(BadRequest, match="chat template"):   # sandboxed: no attribute escapes
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(BadRequest, match="chat template"):
        t.render([{"role": "user", "content": 5}])             # str + int in the template


def test_strftime_now_and_loop_controls():
    t = ChatTemplate("{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.index > 1 %}"
                     "{% break %}{% endif %}{{ m.content }}{% endfor %}")
    year = datetime.now().strftime("%Y")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == year + "a"


# ---------------------------------------------------------------- tools

# Qwen3's tool handling, as its own template does it: the tools listed in the system turn as
# JSON, an assistant's calls written as <tool_call> blocks (arguments as given: a string as
# is, an object through tojson), consecutive tool results grouped in one user turn.
QWEN3_TOOLS = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
""" + GENERATION_PROMPT

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city <b>, in °C",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. Zürich"},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]
# OpenAI-style: the calls' arguments are JSON strings (what clients send back)
TOOL_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 23 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "Sunny, 23 °C; it is noon."},
    {"role": "user", "content": "Thanks! And Oslo?"},
]


def _arguments_as_objects(messages):
    """What a transformers user passes: each call's arguments as an object."""
    import json
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(
                c["function"]["arguments"]))) for c in m["tool_calls"]])
        out.append(m)
    return out


@pytest.mark.parametrize("thinking", [False, True])
def test_tools_and_tool_messages_equal_transformers(hf_tokenizer, smollm2_builder, thinking):
    builder = smollm2_builder(QWEN3_TOOLS)
    for msgs, tools in ((TOOL_TURNS, TOOLS), (TOOL_TURNS[1:2], TOOLS[:1]), (TOOL_TURNS, None)):
        choice = "auto" if tools else "none"
        ours = builder.render_chat(msgs, thinking, ChatInput(tuple(msgs), tools=tuple(tools or ()),
                                                             tool_choice=choice).tool_use())
        ref = _reference(hf_tokenizer, QWEN3_TOOLS, _arguments_as_objects(msgs), tools=tools,
                         add_generation_prompt=True, enable_thinking=thinking)
        assert ours == ref
    text = builder.render_chat(TOOL_TURNS, False, ToolUse(tuple(TOOLS)))
    assert '"description": "Current weather of a city <b>, in °C"' in text     # tojson as is
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": '
            '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n'
            '</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\nsunny, 23 °C\n</tool_response>\n"
            "<tool_response>\n12:00\n</tool_response><|im_end|>") in text


def test_tool_choice_none_renders_no_tools(smollm2_builder):
    builder = smollm2_builder(QWEN3_TOOLS)
    none = ChatInput(tuple(TOOL_TURNS), tools=tuple(TOOLS), tool_choice="none")
    assert none.tool_use() is None
    text = builder.render_chat(TOOL_TURNS, False, none.tool_use())
    assert "<tools>" not in text and text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    named = ChatInput((), tools=tuple(TOOLS), tool_choice={"type": "function",
                                                           "function": {"name": "now"}})
    assert named.tool_use() == ToolUse(tuple(TOOLS), required=True, only="now")
    assert ChatInput((), tools=tuple(TOOLS), tool_choice="required").tool_use().required


@pytest.fixture(scope="module")
def smollm2_builder():
    """A PromptBuilder on SmolLM2 with another chat template."""
    from kestreld.model.convert import smollm2_q8_0_path
    from kestreld.model.load import load_model
    from kestreld.service.config import default_cache_dir
    model = load_model(smollm2_q8_0_path(default_cache_dir(os.environ)))

    def make(template: str) -> PromptBuilder:
        return PromptBuilder(dataclasses.replace(model, chat_template=template), max_seq=4096)
    return make
