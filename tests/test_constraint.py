"""engine/constraint.py: grammars for JSON answers and forced tool calls, the tokenizer
bridge to llguidance, and constrained generation on the real SmolLM2 and on generated
models: every answer parses and validates against its schema (jsonschema), for many seeds
at temperature > 0."""
from __future__ import annotations

import json
import os

import jsonschema
import numpy as np
import pytest

from kestreld.engine.constraint import (Constraint, GrammarVocabulary, answer_grammar,
                                       closed_objects)
from kestreld.engine.generate import Engine
from kestreld.engine.prompt import ChatInput, TextInput
from kestreld.engine.sampler import ResponseFormat, SamplingOptions
from kestreld.errors import BadRequest
from kestreld.model.convert import smollm2_q8_0_path
from kestreld.model.load import load_model
from kestreld.service.config import default_cache_dir
from kestreld.text.tools import ToolUse
from modelgen import prompt_ids

SEEDS = range(20)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "hobbies": {"type": "array", "maxItems": 3,
                                     "items": {"type": "string", "maxLength": 30}}}}
CITY = {"type": "object", "additionalProperties": False,
        "required": ["city", "country", "population", "capital", "zip"],
        "properties": {"city": {"type": "string", "maxLength": 30},
                       "country": {"enum": ["France", "Germany", "Italy", "Spain", "other"]},
                       "population": {"type": "number", "minimum": 0},
                       "capital": {"type": "boolean"},
                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}
# bounded in every direction: a random-weight model must be able to finish it
RECORD = {"type": "object", "additionalProperties": False, "required": ["id", "tag", "ok", "name"],
          "properties": {"id": {"type": "integer", "minimum": -50, "maximum": 999},
                         "tag": {"enum": ["red", "green", 3, None]},
                         "ok": {"type": "boolean"},
                         "name": {"type": "string", "minLength": 1, "maxLength": 6}}}
POINTS = {"type": "array", "minItems": 1, "maxItems": 4,
          "items": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "y": {"anyOf": [{"type": "boolean"}, {"const": "up"}]}}}}
CHOICE = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5},
                    {"type": "string", "pattern": "^[a-c]{2,3}$"},
                    {"type": "object", "additionalProperties": False, "required": ["k"],
                     "properties": {"k": {"type": "array", "maxItems": 2, "items": {"type": "null"}}}}]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "additionalProperties": False,
                                  "required": ["x", "y"],
                                  "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "y": {"type": "integer", "minimum": 0, "maximum": 99}}}}}


def schema_format(schema: dict) -> ResponseFormat:
    return ResponseFormat("json_schema", schema)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(smollm2_q8_0_path(default_cache_dir(os.environ)))


@pytest.fixture(scope="module")
def smollm2_engine(smollm2):
    return Engine(smollm2, max_seq=1024, threads=1)


@pytest.fixture(scope="module")
def vocab(smollm2):
    return GrammarVocabulary(smollm2.tokenizer, smollm2.config.vocab)


def accepts(vocab, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` (tokenized as the model would) to an end."""
    c = Constraint(vocab, grammar)
    return c.matcher.consume_tokens(tokenizer.encode(text)) and c.matcher.is_accepting()


# ---------------------------------------------------------------- the bridge

def test_bridge_spells_every_token_as_the_tokenizer_does(vocab, smollm2):
    tok = smollm2.tokenizer
    lltok = vocab.lltok
    assert lltok.vocab_size == smollm2.config.vocab == 49152
    ids = [i for i in range(tok.vocab_size) if i not in tok.control_ids]
    assert all(lltok.decode_bytes([i]) == tok.token_bytes([i]) for i in ids)
    assert tok.control_ids and all(lltok.is_special_token(i) for i in tok.control_ids)
    assert sorted(lltok.eos_tokens) == sorted(tok.eos_ids)


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_padding_ids_are_never_allowed(zoo, form):
    """Qwen3-like: embedding rows past the tokenizer (HF dir) or named [PAD{id}] and typed
    unused (GGUF) are no text a grammar may spell."""
    m = zoo.get("qwen3_untied")
    model = load_model(str(m.hf_dir if form == "hf" else m.gguf["q8_0"]))
    n_vocab, n_text = model.config.vocab, m.spec.vocab - 8
    c = Constraint(GrammarVocabulary(model.tokenizer, n_vocab),
                   answer_grammar(schema_format({"type": "string"}), None, None))
    c.commit(model.tokenizer.encode('"')[0])          # inside a string: any text may come
    masked = c.mask(np.zeros(n_vocab, dtype=np.float32))
    assert masked.shape == (n_vocab,) and np.isneginf(masked[n_text:]).all()
    assert np.isfinite(masked[:n_text]).sum() > n_text // 2


# ---------------------------------------------------------------- grammars

def test_json_object_grammar(vocab, smollm2):
    g = answer_grammar(ResponseFormat("json_object"), None, None)
    ok = ['{}', '{"a": [1, 2.5e3, {"b": null}], "c": "x\\n\\u00e9"}', '{\n  "k": true\n}']
    bad = ['[1]', '"text"', '{"a": 1} trailing', '{"a": 1', "{'a': 1}", '{"a":' + " " * 30 + '1}']
    tok = smollm2.tokenizer
    assert all(accepts(vocab, tok, g, t) for t in ok)
    assert not any(accepts(vocab, tok, g, t) for t in bad)


def test_schema_grammar(vocab, smollm2):
    g = answer_grammar(schema_format(CITY), None, None)
    tok = smollm2.tokenizer
    good = {"city": "Paris", "country": "France", "population": 2.1e6, "capital": True, "zip": "75001"}
    assert accepts(vocab, tok, g, json.dumps(good))
    for change in ({"country": "Mars"}, {"zip": "7500"}, {"capital": "yes"}, {"extra": 1},
                   {"population": -1}):
        assert not accepts(vocab, tok, g, json.dumps({**good, **change})), change
    assert not accepts(vocab, tok, g, json.dumps({k: v for k, v in good.items() if k != "zip"}))


def test_tool_call_grammars(vocab, smollm2):
    tok = smollm2.tokenizer
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    add = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    required = answer_grammar(None, ToolUse((WEATHER, ADD), required=True), None)
    assert accepts(vocab, tok, required, weather)
    assert accepts(vocab, tok, required, weather + "\n" + add)         # several calls
    assert not accepts(vocab, tok, required, "Sure! " + weather)        # nothing but calls
    assert not accepts(vocab, tok, required, weather.replace("celsius", "kelvin"))
    assert not accepts(vocab, tok, required, add.replace('"add"', '"sub"'))
    named = answer_grammar(None, ToolUse((WEATHER, ADD), required=True, only="add"), None)
    assert accepts(vocab, tok, named, add)
    assert not accepts(vocab, tok, named, weather) and not accepts(vocab, tok, named, add + "\n" + add)
    # "auto" alone is free text; with a response_format: the JSON or calls
    assert answer_grammar(None, ToolUse((WEATHER,)), None) is None
    either = answer_grammar(schema_format(PERSON), ToolUse((WEATHER, ADD)), None)
    assert accepts(vocab, tok, either, add)
    assert accepts(vocab, tok, either, '{"name": "Ada", "age": 36, "hobbies": []}')
    assert not accepts(vocab, tok, either, "plain text")
    assert answer_grammar(None, None, None) is None


def test_one_call_when_parallel_calls_are_off(vocab, smollm2):
    tok = smollm2.tokenizer
    add = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    one = answer_grammar(None, ToolUse((WEATHER, ADD), required=True, parallel=False), None)
    assert accepts(vocab, tok, one, add) and not accepts(vocab, tok, one, add + "\n" + add)


def test_objects_that_list_properties_are_closed(vocab, smollm2):
    """A schema that does not set additionalProperties: only its listed keys (llama.cpp's
    and OpenAI strict mode's reading), at every depth; an object without properties and
    an explicit additionalProperties stay as they are."""
    loose = {"type": "object", "required": ["a"],
             "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                            "properties": {"type": "string"}},
             "$defs": {"d": {"properties": {"x": {}}}},
             "anyOf": [{"properties": {"y": {}}}, {"type": "object"}]}
    closed = closed_objects(loose)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]   # a key's name
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert closed["anyOf"][1] == {"type": "object"}
    assert "additionalProperties" not in loose                               # a copy
    assert closed_objects({"properties": {}, "additionalProperties": True})["additionalProperties"]
    g = answer_grammar(schema_format({k: loose[k] for k in ("type", "required", "properties")}),
                       None, None)
    tok = smollm2.tokenizer
    assert accepts(vocab, tok, g, '{"a": {"b": 1}, "properties": "p"}')
    assert not accepts(vocab, tok, g, '{"a": {"b": 1}, "invented": 1}')
    assert not accepts(vocab, tok, g, '{"a": {"b": 1, "c": 2}}')
    assert accepts(vocab, tok, answer_grammar(ResponseFormat("json_object"), None, None),
                   '{"any": 1, "key": 2}')


def test_a_thinking_block_may_come_first(vocab, smollm2):
    tok = smollm2.tokenizer
    fmt = ResponseFormat("json_object")
    may = answer_grammar(fmt, None, False)
    assert accepts(vocab, tok, may, '<think>\nA {bracket} </tool_call> or two.\n</think>\n\n{"a": 1}')
    assert accepts(vocab, tok, may, '{"a": 1}')
    assert not accepts(vocab, tok, may, 'Hmm {"a": 1}')
    inside = answer_grammar(fmt, None, True)          # the prompt opened the block
    assert accepts(vocab, tok, inside, 'so {"a": 1} it is.\n</think>\n\n{"a": 1}')
    assert not accepts(vocab, tok, inside, '{"a": 1}')
    call = '<tool_call>\n{"name": "add", "arguments": {"x": 3, "y": 4}}\n</tool_call>'
    forced = answer_grammar(None, ToolUse((ADD,), required=True), False)
    assert accepts(vocab, tok, forced, "<think>\nadd them\n</think>\n\n" + call)


def test_end_of_sequence_only_where_the_grammar_ends(vocab, smollm2):
    tok = smollm2.tokenizer
    eos = sorted(tok.eos_ids)
    zeros = np.zeros(smollm2.config.vocab, dtype=np.float32)
    c = Constraint(vocab, answer_grammar(schema_format(PERSON), None, None))
    for t in tok.encode('{"name": "Ada", "age": 36, "hobbies": ["chess"]'):
        assert np.isneginf(c.mask(zeros)[eos]).all() and not c.finished
        c.commit(t)
    c.commit(tok.encode("}")[0])
    assert c.finished                              # nothing may follow a complete object
    masked = c.mask(zeros)
    assert np.isfinite(masked[eos]).all() and np.isfinite(masked).sum() == len(eos)
    # after a first call another may follow, or the end
    c = Constraint(vocab, answer_grammar(None, ToolUse((ADD,), required=True), None))
    c.matcher.consume_tokens(tok.encode('<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>'))
    assert not c.finished
    masked = c.mask(zeros)
    assert np.isfinite(masked[eos]).all() and np.isfinite(masked[tok.encode("\n")[0]])


def test_schemas_the_engine_cannot_use_are_bad_requests(vocab):
    for schema in ({"$ref": "#/$defs/missing"},
                   {"type": "integer", "minimum": 5, "maximum": 1},
                   {"type": "string", "pattern": "(unclosed"}):
        with pytest.raises(BadRequest, match="JSON schema cannot be used"):
            Constraint(vocab, answer_grammar(schema_format(schema), None, None))


CYCLES = {"self": {"$ref": "#"},
          "two": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                  "$ref": "#/$defs/a"},
          "allOf": {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
          "anyOf": {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}}


@pytest.mark.parametrize("schema", CYCLES.values(), ids=CYCLES.keys())
def test_cycles_with_no_way_out_are_refused_before_the_prefill(vocab, schema):
    """Refused when the constraint is built (before any prefill), shortly, no state dump."""
    with pytest.raises(BadRequest, match="allows no answer") as e:
        Constraint(vocab, answer_grammar(schema_format(schema), None, None))
    assert len(str(e.value)) < 300 and "<state>" not in str(e.value)


def test_engine_limits_mid_answer_are_short_bad_requests(vocab, smollm2):
    """3,000 object branches pass the compile but outgrow the parser at the first
    character (the protocol refuses so many anyOf branches before this)."""
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                         "required": [f"k{i}"]} for i in range(3000)]}
    c = Constraint(vocab, answer_grammar(schema_format(schema), None, None))
    zeros = np.zeros(vocab.n_vocab, dtype=np.float32)
    with pytest.raises(BadRequest, match="beyond the grammar engine's limits") as e:
        for _ in range(4):
            c.commit(int(np.flatnonzero(np.isfinite(c.mask(zeros)))[-1]))
    assert len(str(e.value)) < 1000 and "<state>" not in str(e.value)


# ---------------------------------------------------------------- generation

def _valid(completion, schema) -> None:
    assert completion.finish_reason == "stop", completion
    jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("question, schema", [
    ("Describe a fictional person as JSON with name, age and hobbies.", PERSON),
    ("Give facts about Paris as JSON.", CITY),
    ("Three colours and how much you like each, as a JSON list.",
     {"type": "array", "minItems": 3, "maxItems": 3,
      "items": {"type": "object", "additionalProperties": False, "required": ["colour", "score"],
                "properties": {"colour": {"type": "string", "maxLength": 20},
                               "score": {"type": "number", "minimum": 0, "maximum": 10}}}}),
], ids=["person", "city", "colours"])
def test_smollm2_answers_valid_json_for_every_seed(smollm2_engine, question, schema):
    chat = ChatInput(({"role": "user", "content": question},))
    for seed in SEEDS:
        c = smollm2_engine.run(chat, SamplingOptions(max_tokens=300, temperature=0.8, seed=seed,
                                                     response_format=schema_format(schema)))
        _valid(c, schema)
    _valid(smollm2_engine.run(chat, SamplingOptions(max_tokens=300,
                                                    response_format=schema_format(schema))), schema)


def test_smollm2_any_json_object(smollm2_engine, vocab):
    """Any JSON object has no bound: a small model sometimes rambles in a string until
    max_tokens (finish "length", as OpenAI's API says). Every finished answer is an
    object; every unfinished one a prefix the grammar would continue."""
    chat = ChatInput(({"role": "user", "content": "Describe a cat as a JSON object with three "
                                                  "short fields."},))
    fmt = ResponseFormat("json_object")
    finished = 0
    for seed in range(10):
        c = smollm2_engine.run(chat, SamplingOptions(max_tokens=160, temperature=0.6, seed=seed,
                                                     response_format=fmt))
        if c.finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and len(c.ids) == 160
            prefix = Constraint(vocab, answer_grammar(fmt, None, None))
            assert prefix.matcher.consume_tokens(c.ids) and not prefix.matcher.is_accepting()
    assert finished >= 1


@pytest.mark.parametrize("name", ["qwen3_tied", "llama"])
def test_generated_models_answer_valid_json_for_every_seed(zoo, name):
    """Random weights: the grammar alone keeps the answer valid."""
    engine = Engine(load_model(str(zoo.get(name).gguf["q8_0"])), max_seq=2048)
    ids = prompt_ids(name, 12, seed=1)
    for schema in (RECORD, POINTS, CHOICE):
        for seed in SEEDS:    # room for blanks: up to 22 between any two JSON tokens
            c = engine.generate(ids, SamplingOptions(max_tokens=1500, temperature=1.0, seed=seed,
                                                     response_format=schema_format(schema)))
            _valid(c, schema)


def test_forced_calls_on_smollm2(smollm2_engine):
    """SmolLM2's template shows no tools; the grammar still makes every answer calls: valid
    calls of the offered functions ("required": one or more, distinct; this model tends to
    repeat a call, and the first repeat ends the answer), exactly one call with
    parallel_tool_calls false, or exactly one call of the named function; never text."""
    ask = ({"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"},)
    tools = {"get_weather": WEATHER, "add": ADD}
    named = {"type": "function", "function": {"name": "add"}}
    for seed in range(8):
        opts = SamplingOptions(max_tokens=200, temperature=0.9, seed=seed)
        c = smollm2_engine.run(ChatInput(ask, tools=(WEATHER, ADD), tool_choice="required"), opts)
        assert c.tool_calls and (c.finish_reason, c.text) == ("tool_calls", "")
        assert len({(t.name, t.arguments) for t in c.tool_calls}) == len(c.tool_calls)
        for call in c.tool_calls:
            jsonschema.validate(json.loads(call.arguments), tools[call.name]["function"]["parameters"])
        c = smollm2_engine.run(ChatInput(ask, tools=(WEATHER, ADD), tool_choice="required",
                                         parallel_tool_calls=False), opts)
        assert (c.finish_reason, c.text, len(c.tool_calls)) == ("tool_calls", "", 1)
        c = smollm2_engine.run(ChatInput(ask, tools=(WEATHER, ADD), tool_choice=named), opts)
        assert c.finish_reason == "tool_calls" and [t.name for t in c.tool_calls] == ["add"]
        jsonschema.validate(json.loads(c.tool_calls[0].arguments), ADD["function"]["parameters"])


def test_text_prompts_take_a_response_format_too(smollm2_engine):
    c = smollm2_engine.run(TextInput(text="A JSON list of three primes:"),
                           SamplingOptions(max_tokens=60, response_format=schema_format(
                               {"type": "array", "items": {"type": "integer"}, "maxItems": 3})))
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text), list)


def test_a_constrained_answer_ends_with_its_grammar_even_with_ignore_eos(zoo):
    """After a call the grammar allows another or the end: the end ends the answer, whatever
    ignore_eos says, and is no text."""
    engine = Engine(load_model(str(zoo.get("llama").gguf["q8_0"])), max_seq=2048)
    prompt = engine.prompt(ChatInput(({"role": "user", "content": "add"},), tools=(ADD,),
                                     tool_choice="required"))
    for seed in range(5):
        c = engine.generate(prompt, SamplingOptions(max_tokens=1500, temperature=1.0, seed=seed,
                                                    ignore_eos=True))
        assert c.finish_reason in ("tool_calls", "length") and c.tool_calls
        assert not set(c.ids) & engine.tokenizer.eos_ids and "<|im_end|>" not in c.text
