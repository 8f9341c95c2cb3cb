"""What the model reads: a request (a text, token ids, or a conversation) -> a `Prompt`.

    TextInput(text=...)  tokenized with the model's special tokens (BOS where it wants one)
    TextInput(ids=...)   the ids as given
    ChatInput(messages)  rendered with the model's own chat template (whose text holds its
                         special tokens), tokenized with the client's text as text
                         (text/control.py); image parts decoded, preprocessed and
                         their placeholders widened to the image's tokens (Qwen3-VL);
                         tools rendered by the template too (text/tools.py)

A `Prompt` holds the ids and, with images, their `VisionPrompt` (M-RoPE positions, prefix
keys, the images to encode). `keys` is what the prefix rule compares. It also says how the
answer is read: its thinking block, its tool calls.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from ..errors import BadRequest, PromptTooLong
from ..text.chat import ChatTemplate
from ..text.control import ControlGuard
from ..text.reasoning import opens_thinking
from ..text.tools import ToolUse, template_messages
from ..vision.images import decode_image, preprocess, read_image_part
from ..vision.prompt import VisionPrompt, build_prompt, chat_images


@dataclass(frozen=True)
class TextInput:
    """A raw completion prompt: exactly one of `text` or `ids`."""
    text: Optional[str] = None
    ids: Optional[tuple] = None

    def __post_init__(self):
        if (self.text is None) == (self.ids is None):
            raise ValueError("TextInput needs exactly one of text or ids")


@dataclass(frozen=True)
class ChatInput:
    """A conversation: messages as ({"role", "content": str | (part, ...)}, ...), a part
    being {"type": "text", "text"} or {"type": "image", "path" | "data"}; an assistant
    message may hold `tool_calls` ([{"id", "type": "function", "function": {"name",
    "arguments": JSON str}}]), a "tool" message answers one (`tool_call_id`).
    `split_reasoning`: the answer's thinking block comes back apart (text/reasoning.py).
    `tools`: OpenAI function specs the answer may call ({"type": "function", "function":
    {"name", "description", "parameters"}}); `tool_choice`: "auto", "none" (no tools
    rendered), "required", or {"type": "function", "function": {"name"}} (that one);
    `parallel_tool_calls` False: at most one call."""
    messages: tuple
    enable_thinking: bool = False
    split_reasoning: bool = False
    tools: tuple = ()
    tool_choice: Union[str, dict] = "auto"
    parallel_tool_calls: bool = True

    def tool_use(self) -> Optional[ToolUse]:
        """The tools the answer may call and how, or None (no tools, or "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            if name not in {t["function"]["name"] for t in self.tools}:
                raise BadRequest(f"tool_choice names function {name!r}, which is not in tools")
            return ToolUse(self.tools, required=True, only=name,
                           parallel=self.parallel_tool_calls)
        return ToolUse(self.tools, required=self.tool_choice == "required",
                       parallel=self.parallel_tool_calls)


Request = Union[TextInput, ChatInput]


@dataclass
class Prompt:
    """Token ids for the model, and the images they hold (Qwen3-VL) if any. How the answer
    is read: `thinking` None (no thinking block), False (it may open one) or True (it
    starts inside one the prompt opened); `split_reasoning`: the block comes back apart
    from the text; `tools`: the tool calls it may (or must) make, parsed out of its text."""
    ids: list
    vision: Optional[VisionPrompt] = None
    thinking: Optional[bool] = None
    split_reasoning: bool = False
    tools: Optional[ToolUse] = None

    @property
    def keys(self) -> list:
        """The prefix-match key of each token: its id, or an image's key for its placeholders."""
        return self.vision.keys if self.vision is not None else self.ids


class PromptBuilder:
    """Turns requests into prompts for one model. It reads the tokenizer, the template and
    the vision config only, never the KV cache, so `tokenize` is safe from any thread."""

    def __init__(self, model, max_seq: int, image_dir: Optional[str] = None):
        self.model = model
        self.tokenizer = model.tokenizer
        self.chat = ChatTemplate(model.chat_template)
        self.max_seq = max_seq
        self.max_text_chars = max_seq * self.tokenizer.max_token_bytes
        self.image_dir = image_dir  # the only place image paths may be read from (None: nowhere)

    def tokenize(self, text: str, add_special: bool = False) -> list:
        """Token ids of `text`. A text that cannot fit in max_seq tokens (each token covers
        at most max_token_bytes bytes) is refused before tokenizing, which would cost
        hundreds of bytes of memory per token."""
        self._check_length(text)
        return self.tokenizer.encode(text, add_special=add_special)

    def _check_length(self, text: str) -> None:
        if len(text) > self.max_text_chars:
            raise PromptTooLong(f"a text of {len(text)} characters cannot fit in max_seq="
                                f"{self.max_seq} tokens (at most {self.max_text_chars})")

    def render_chat(self, messages, enable_thinking: bool = False,
                    tools: Optional[ToolUse] = None) -> str:
        """The prompt text of a conversation, from the model's own chat template."""
        tok = self.tokenizer
        special = {"bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                   "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else ""}
        return self.chat.render(template_messages(messages), add_generation_prompt=True,
                                enable_thinking=enable_thinking,
                                tools=list(tools.tools) if tools is not None else None, **special)

    def build(self, request: Request) -> Prompt:
        """The prompt of a request. Bad images or image parts for a model without a vision
        encoder: BadRequest; a text too long for the context: PromptTooLong."""
        if isinstance(request, ChatInput):
            return self._chat(request)
        if request.ids is not None:
            return Prompt(list(request.ids))
        return Prompt(self.tokenize(request.text, add_special=True))

    def chat_text(self, request: ChatInput,
                  guard: Optional[ControlGuard] = None) -> tuple[str, list]:
        """The prompt text of a conversation (images as their placeholders), and its
        image parts; BadRequest for images to a model without a vision encoder. With
        `guard`, the client's control-token texts are its placeholders (text/control.py)."""
        rendered, parts = chat_images([_flatten_text(m) for m in request.messages])
        if parts and self.model.vision is None:
            hint = (" (a Qwen3-VL text GGUF: start kestreld with --mmproj FILE for its vision "
                    "encoder)" if self.model.config.arch == "qwen3vl" else "")
            raise BadRequest(f"the model {self.model.config.name} takes no images{hint}")
        tools = request.tool_use()
        if guard is not None:
            rendered = guard.hide(rendered)
            tools = None if tools is None else replace(tools, tools=guard.hide(tools.tools))
        return self.render_chat(rendered, request.enable_thinking, tools), parts

    def _chat(self, request: ChatInput) -> Prompt:
        guard = ControlGuard(self.tokenizer)       # the client's text stays text
        text, parts = self.chat_text(request, guard)
        vision = self.model.vision
        tools = request.tool_use()
        self._check_length(guard.restore(text))
        ids = guard.encode(text)
        thinking = True if opens_thinking(text) else (False if request.enable_thinking else None)
        answer = dict(thinking=thinking, split_reasoning=request.split_reasoning, tools=tools)
        if not parts:
            return Prompt(ids, **answer)
        images = [preprocess(decode_image(read_image_part(p, self.image_dir)), vision.cfg.image)
                  for p in parts]
        ids, vp = build_prompt(ids, images, vision.cfg)
        return Prompt(ids, vp, **answer)


def _flatten_text(message: dict) -> dict:
    """A message whose content is only text parts, with their texts joined into one string
    (what chat templates without list support expect); other messages as they are."""
    content = message.get("content")
    if isinstance(content, (list, tuple)) and all(p.get("type") == "text" for p in content):
        return dict(message, content="".join(p["text"] for p in content))
    return dict(message)
