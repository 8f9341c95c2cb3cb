"""Chat templates: rendered text equals transformers' apply_chat_template on the same string."""
import logging
from datetime import datetime

import pytest

from kestreld.text.chat import CHATML_TEMPLATE, ChatTemplate
from kestreld.model.gguf_file import open_gguf
from kestreld.errors import BadRequest
from _loader_models import smollm2_gguf

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
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

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
