"""OpenAI's Responses API (`POST /v1/responses`) <-> Kestrel's RPC `chat` params and results.

A thin mapping, like openai.py (whose helpers it shares): a request's `instructions` and
`input` (a text, or items: messages, `function_call` and `function_call_output`) become
the messages of the RPC `chat` method, its function tools and sampling fields the same
options; the completion map, or the `token` payloads of a stream, become a `response`
object whose `output` holds a `reasoning` item (Qwen3's thinking block), a `message` item
(the text) and a `function_call` item per call, or the stream's events:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:    response.content_part.added, response.output_text.delta ...,
                  response.output_text.done, response.content_part.done
      reasoning:  response.content_part.added, response.reasoning_text.delta ...,
                  response.reasoning_text.done, response.content_part.done
      call:       response.function_call_arguments.delta, ...arguments.done
    response.output_item.done; then response.completed (response.incomplete when
    max_output_tokens cut the answer, response.failed after an error).

Nothing is stored: the daemon keeps no conversations (one model, one KV arena, memory
bounded on a board), so `store` is answered false and `previous_response_id` is refused;
a client sends the conversation as input items, and the prefix cache makes resending the
same history cheap.
"""
from __future__ import annotations

import time
from typing import Optional

from ..errors import BadRequest, KestrelError
from .openai import (TokenBytes, Translated, check_model, error_body, messages_of, new_id,
                     sampling)

# fields a request may hold that change nothing here (OpenAI's bookkeeping)
_IGNORED = ("metadata", "user", "store", "truncation", "include", "service_tier",
            "prompt_cache_key", "safety_identifier", "background", "stream_options",
            "top_logprobs", "max_tool_calls")
_FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
           "seed", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
           "logit_bias", "stream", "tools", "tool_choice", "parallel_tool_calls", "text",
           "reasoning", "previous_response_id") + _IGNORED
# Qwen3 thinks unless a request asks for no reasoning effort
_NO_THINKING = ("none", "minimal")


# ---------------------------------------------------------------- requests

def responses_request(body, model_id: str, strict: tuple = ()) -> Translated:
    """A Responses API request -> the RPC `chat` params (BadRequest naming the field)."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(str(k)[:40] for k in body if k not in _FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown[:8])}", param=unknown[0])
    check_model(body, model_id, strict)
    if body.get("previous_response_id") is not None:
        raise BadRequest("previous_response_id: this daemon stores no responses; send the "
                         "conversation as input items (function_call, function_call_output, "
                         "messages)", param="previous_response_id")
    if not isinstance(body.get("store", False), bool):
        raise BadRequest("store must be true or false (nothing is stored either way)",
                         param="store")
    if body.get("background") is not None and body.get("background") is not False:
        raise BadRequest("background must be false: responses run while the client waits",
                         param="background")
    options, stream = sampling(body)
    if body.get("max_output_tokens") is not None:
        options["max_tokens"] = body["max_output_tokens"]
    messages = _input(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    params = {"messages": messages_of(messages), "split_reasoning": True, "stream": stream,
              "enable_thinking": _thinking(body.get("reasoning")), **options}
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        params["response_format"] = fmt
    tools = _tools(body.get("tools"))
    if tools:
        params["tools"] = tools
        if body.get("tool_choice") is not None:
            params["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("parallel_tool_calls") is not None:
            params["parallel_tool_calls"] = body["parallel_tool_calls"]
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {},
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"),
                          "summary": None}}
    return Translated("chat", params, stream, False, None, 1, "input", echo)


def _thinking(reasoning) -> bool:
    if reasoning is None:
        return False
    if not isinstance(reasoning, dict):
        raise BadRequest("reasoning must be an object ({\"effort\": ...})", param="reasoning")
    effort = reasoning.get("effort")
    return effort is not None and effort not in _NO_THINKING


def _input(value) -> list:
    """`input` -> chat messages (OpenAI's chat shape, before openai.messages_of)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("input must be a string or a non-empty array of items", param="input")
    out: list = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append({"role": item.get("role"), "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)       # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _content(output, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            continue                 # past thinking is not shown again (Qwen3's template drops it)
        else:
            raise BadRequest(f"{where}.type: Kestrel takes message, function_call, "
                             f"function_call_output and reasoning items, got {str(kind)[:40]!r}",
                             param="input")
    return out


def _content(content, where: str):
    """A message's content: a string, or parts (input_text / output_text / input_image)
    as chat parts."""
    if not isinstance(content, list):
        return content               # a string, or a wrong type the RPC check names
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": part.get("image_url")})
        elif kind != "refusal":
            raise BadRequest(f"{where}.content[{j}]: a part has type input_text, output_text "
                             f"or input_image, got {str(kind)[:40]!r}", param="input")
    return parts


def _tools(tools) -> list:
    """Responses tools ({"type": "function", "name", ...}) -> chat tools."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("tools must be an array", param="tools")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadRequest(f"tools[{j}]: only function tools are served, got "
                             f"{str(kind)[:40]!r}", param="tools")
        out.append({"type": "function",
                    "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice                    # "auto" | "none" | "required", or a wrong value the RPC names


def _text_format(text) -> Optional[dict]:
    """`text.format` -> the chat response_format (None: free text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        raise BadRequest("text must be {\"format\": {\"type\": ...}}", param="text")
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt                       # json_object, or a wrong value the RPC names


# ---------------------------------------------------------------- answers

def _usage(result: dict) -> dict:
    u = result["usage"]
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


class ResponseAnswer:
    """One Responses API answer: the whole `response` object, or its stream of events
    (the same driving as openai.Answer: opening, token, finish, closing, failure)."""
    EVENT_NAMES = True                # SSE lines: `event: TYPE` then `data: JSON`
    DONE = b""                        # the stream ends with response.completed

    def __init__(self, req: Translated, model_id: str, token_bytes: TokenBytes, created: int):
        self.echo = req.echo
        self.id = new_id("resp")
        self.model = model_id
        self.created = created
        self.seq = 0
        self.output: list = []        # the finished items
        self.item: Optional[dict] = None   # the item being streamed
        self.part_text = ""

    # ---- the response object

    def _response(self, status: str, output: list, result: Optional[dict] = None,
                  error: Optional[KestrelError] = None) -> dict:
        incomplete = None
        if result is not None and result["finish_reason"] == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "model": self.model, "output": output,
               "error": None, "incomplete_details": incomplete,
               "previous_response_id": None, "store": False, "truncation": "disabled",
               "usage": _usage(result) if result is not None else None,
               "completed_at": int(time.time()) if status == "completed" else None,
               "user": None, **self.echo}
        if error is not None:
            out["error"] = {"code": error_body(error)["error"]["code"], "message": str(error)}
        return out

    def response(self, results: list) -> dict:
        """The whole `response` object of one completion map."""
        result = results[0]
        output = []
        if result.get("reasoning"):
            output.append(self._reasoning_item(result["reasoning"]))
        if result["text"] or not result.get("tool_calls"):
            output.append(self._message_item(result["text"]))
        output += [self._call_item(c) for c in result.get("tool_calls") or ()]
        return self._response("completed", output, result)

    def _message_item(self, text: str, status: str = "completed") -> dict:
        return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
                "content": [_text_part(text)] if status == "completed" else []}

    def _reasoning_item(self, text: str, status: str = "completed") -> dict:
        return {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": status,
                "content": [_reasoning_part(text)] if status == "completed" else []}

    @staticmethod
    def _call_item(call: dict, status: str = "completed") -> dict:
        f = call["function"]
        return {"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": f["name"], "arguments": f["arguments"], "status": status}

    # ---- the stream

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def opening(self, index: int) -> list:
        """response.created and response.in_progress."""
        return [self._event(kind, response=self._response("in_progress", []))
                for kind in ("response.created", "response.in_progress")]

    def _open(self, kind: str) -> list:
        """Close the item being streamed if it is not of `kind`; open one of `kind`."""
        if self.item is not None and self.item["type"] == kind:
            return []
        out = self._close()
        make = self._message_item if kind == "message" else self._reasoning_item
        self.item, self.part_text = make("", "in_progress"), ""
        part = _text_part("") if kind == "message" else _reasoning_part("")
        at = {"output_index": len(self.output)}
        out.append(self._event("response.output_item.added", item=dict(self.item), **at))
        out.append(self._event("response.content_part.added", item_id=self.item["id"],
                               content_index=0, part=part, **at))
        return out

    def _close(self) -> list:
        """The done events of the item being streamed (none if none is)."""
        if self.item is None:
            return []
        item, text = self.item, self.part_text
        at = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if item["type"] == "message":
            part = _text_part(text)
            done = self._event("response.output_text.done", text=text, logprobs=[], **at)
        else:
            part = _reasoning_part(text)
            done = self._event("response.reasoning_text.done", text=text, **at)
        item = dict(item, status="completed", content=[part])
        self.output.append(item)
        self.item = None
        return [done, self._event("response.content_part.done", part=part, **at),
                self._event("response.output_item.done", item=item,
                            output_index=at["output_index"])]

    def _delta(self, kind: str, text: str) -> list:
        out = self._open(kind)
        self.part_text += text
        name = ("response.output_text.delta" if kind == "message"
                else "response.reasoning_text.delta")
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(name, item_id=self.item["id"], output_index=len(self.output),
                               content_index=0, delta=text, **extra))
        return out

    def _calls(self, calls: list) -> list:
        out = self._close()
        for call in calls:
            item = self._call_item(call)
            at = {"output_index": len(self.output)}
            out.append(self._event("response.output_item.added",
                                   item=dict(item, arguments="", status="in_progress"), **at))
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   delta=item["arguments"], **at))
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   name=item["name"], arguments=item["arguments"], **at))
            out.append(self._event("response.output_item.done", item=item, **at))
            self.output.append(item)
        return out

    def token(self, payload: dict) -> list:
        """The events of a `token` payload: thinking, text, calls, in that order."""
        out = []
        if payload.get("reasoning"):
            out += self._delta("reasoning", payload["reasoning"])
        in_message = self.item is not None and self.item["type"] == "message"
        if payload["text"] and (payload["text"].strip() or in_message):
            out += self._delta("message", payload["text"])
        if payload.get("tool_calls"):
            out += self._calls(payload["tool_calls"])
        return out

    def finish(self, result: dict) -> list:
        """The end of the answer: the open item closed, then response.completed (or
        response.incomplete when the length limit cut it)."""
        out = self._close()
        if not self.output:              # an empty answer is still one (empty) message
            out += self._open("message") + self._close()
        final = self._response("completed", self.output, result)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=final)]

    def closing(self, results: list) -> list:
        return []

    def failure(self, error: KestrelError) -> list:
        """An error after the stream began: response.failed."""
        return self._close() + [self._event("response.failed", response=self._response(
            "failed", self.output, error=error))]
