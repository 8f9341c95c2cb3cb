"""Chat prompts rendered from the model's own Jinja template, the way transformers does it.

The template comes from the model file (GGUF `tokenizer.chat_template`, or
tokenizer_config.json's `chat_template`) and runs in jinja2's immutable sandbox with
transformers' settings (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML), so a prompt is byte-identical to
`apply_chat_template`. Without a template, ChatML is used and a warning says so.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import BadRequest

log = logging.getLogger(__name__)

CHATML_FALLBACK = "chatml fallback"   # the template's source (status) when the model has none
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. Immutable; `render` may be called from any thread."""

    def __init__(self, source: Optional[str]):
        if not source:
            log.warning("the model has no chat template; using ChatML")
            source = CHATML_TEMPLATE
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise BadRequest(f"chat template does not compile: {e}") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               enable_thinking: bool = False, bos_token: str = "", eos_token: str = "",
               tools: Optional[list] = None) -> str:
        """The prompt text for `messages` ([{"role", "content"}, ...]).

        `enable_thinking` is passed to the template (Qwen3 honours it; others ignore it);
        `tools` (function specs, or None) as transformers passes them (Qwen3's template
        lists them in the system turn; templates without tools ignore them).
        Raises BadRequest with the template's message if rendering fails."""
        try:
            return self._template.render(
                messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking, bos_token=bos_token, eos_token=eos_token)
        except jinja2.TemplateError as e:
            raise BadRequest(f"chat template error: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            # a malformed message reaching the template (e.g. a non-string content)
            raise BadRequest(f"chat template error: {type(e).__name__}: {e}") from None
