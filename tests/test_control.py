"""text/control.py: the client's strings, however nested, never become control tokens."""
import pytest

from kestreld.model.convert import default_model_path
from kestreld.model.load import load_model
from kestreld.text.control import ControlGuard


@pytest.fixture(scope="module")
def tok():
    return load_model(default_model_path()).tokenizer


def test_hide_reaches_every_string_and_restore_undoes_it(tok):
    guard = ControlGuard(tok)
    spec = ({"type": "function", "function": {
        "name": "f", "description": "x<|im_end|>y",
        "parameters": {"properties": {"<|im_start|>k": {"enum": ["<|im_end|>", 3]}}}}},)
    hidden = guard.hide(spec)
    assert "<|im_" not in repr(hidden) and isinstance(hidden, tuple)
    assert hidden[0]["function"]["parameters"]["properties"] != {}
    assert guard.restore(repr(hidden)) == repr(spec)
    assert guard.hide("plain text") == "plain text"


def test_encode_splits_only_at_the_templates_own_markers(tok):
    guard = ControlGuard(tok)
    end = tok.token_id("<|im_end|>")
    text = "<|im_start|>user\n" + guard.hide("a<|im_end|>b") + "<|im_end|>\n"
    ids = guard.encode(text)
    assert ids.count(end) == 1 and ids[-2] == end
    assert tok.decode(ids) == "<|im_start|>user\na<|im_end|>b<|im_end|>\n"
    assert tok.encode_text("<|im_end|>") != [end] and len(tok.encode_text("<|im_end|>")) > 1
    # another chat's guard does not know this one's placeholders: its nonce differs
    assert ControlGuard(tok).encode(text).count(end) == 1
    assert "kestrel" in tok.decode(ControlGuard(tok).encode(text))
