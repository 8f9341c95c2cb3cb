"""kestrelctl/conversation.py: the messages kestrelctl keeps, sends, saves and loads."""
from __future__ import annotations

import json

import pytest

from kestreld.errors import BadRequest
from kestreld.protocol import validate_params
from kestrelctl.conversation import Conversation, read_image


def test_system_prompt_clear_and_drop():
    c = Conversation("Be brief.")
    c.add_user("Hi")
    c.add_assistant("Hello.")
    c.set_system("Be kind.")
    assert c.messages == [{"role": "system", "content": "Be kind."},
                          {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello."}]
    c.add_user("And?")
    assert c.drop_last_user() == [] and len(c.messages) == 3
    c.clear()
    assert c.messages == [{"role": "system", "content": "Be kind."}]
    c.set_system(None)
    assert c.messages == [] and c.system is None


def test_images_are_sent_as_bytes_and_saved_as_paths(tmp_path):
    picture = tmp_path / "a.png"
    picture.write_bytes(b"\x89PNG-bytes")
    c = Conversation()
    c.add_user("What is this?", [read_image(str(picture))])
    c.add_assistant("A picture.")
    sent = c.wire()
    assert sent[0] == {"role": "user", "content": [{"type": "image", "data": b"\x89PNG-bytes"},
                                                   {"type": "text", "text": "What is this?"}]}
    assert validate_params("chat", [{"messages": sent}], 100).messages[0]["content"][0]["data"]
    c.save(str(tmp_path / "c.json"))
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved[0]["content"][0] == {"type": "image", "path": str(picture)}
    loaded = Conversation.load(str(tmp_path / "c.json"))
    assert loaded.messages == saved and loaded.wire() == sent
    picture.write_bytes(b"changed")                     # the bytes are read at /load
    assert Conversation.load(str(tmp_path / "c.json")).wire()[0]["content"][0]["data"] == b"changed"
    c.add_user("Again?", [read_image(str(picture))])
    assert c.drop_last_user() == [(str(picture), b"changed")]


def test_load_refuses_what_is_not_chat_messages(tmp_path):
    cases = {"not JSON": "{", "does not hold chat messages": '{"role": "user"}',
             "allowed here: role, content": '[{"role": "user", "content": "x", "name": "y"}]',
             "cannot read image": '[{"role": "user", "content": [{"type": "image", "path": "/nope.png"}]}]'}
    for i, (message, text) in enumerate(cases.items()):
        (tmp_path / f"{i}.json").write_text(text)
        with pytest.raises(BadRequest, match=message):
            Conversation.load(str(tmp_path / f"{i}.json"))
    (tmp_path / "empty.json").write_text("[]")
    assert Conversation.load(str(tmp_path / "empty.json")).messages == []
    with pytest.raises(BadRequest, match="cannot read"):
        Conversation.load(str(tmp_path / "missing.json"))
    with pytest.raises(BadRequest, match="cannot write"):
        Conversation().save(str(tmp_path / "no" / "dir.json"))
