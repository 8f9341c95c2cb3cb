"""service/status.py: the model facts of the status map (what `kestrelctl show` prints),
each checked against the model files themselves."""
from __future__ import annotations

import os

import gguf
import pytest

import modelgen
import modelgen_moe
from daemon import Daemon
from kestreld.model.load import load_model
from kestreld.service.status import path_bytes


def _matrix_params(path) -> dict:
    """Parameters of the file's matrices (2-D and stacked 3-D tensors) by role."""
    r = gguf.GGUFReader(str(path))
    out = {"router": 0, "quantized": 0}
    for t in r.tensors:
        if len(t.shape) >= 2:
            out["router" if t.name.endswith("ffn_gate_inp.weight") else "quantized"] += int(t.n_elements)
    return out


@pytest.mark.parametrize("name", ["qwen3moe_norm", "qwen3moe_pages"])   # untied, tied
def test_weight_types_share_of_the_matrix_parameters(name, tmp_path):
    gen = modelgen_moe.generate(name, tmp_path, ("q8_0",), hf=False)
    want = _matrix_params(gen.gguf["q8_0"])
    total = want["router"] + want["quantized"]
    types = load_model(str(gen.gguf["q8_0"])).weights.type_shares()
    # the routers stay float32; a tied output matrix is the embedding, counted once
    assert types == {"q8_0": round(want["quantized"] / total, 6),
                     "f32": round(want["router"] / total, 6)}


def test_dense_weight_types_and_template_sources(tmp_path):
    gen = modelgen.generate("qwen3_tied", tmp_path, ("q8_0",))
    model = load_model(str(gen.gguf["q8_0"]))
    assert model.weights.type_shares() == {"q8_0": 1.0} and model.weights.main_type() == "q8_0"
    assert model.chat_template_source == "gguf"
    assert load_model(str(gen.hf_dir)).chat_template_source == "tokenizer_config.json"
    (gen.hf_dir / "chat_template.jinja").write_text(modelgen.CHAT_TEMPLATE)
    assert load_model(str(gen.hf_dir)).chat_template_source == "chat_template.jinja"
    files = [e for e in os.scandir(gen.hf_dir) if e.is_file()]
    assert path_bytes(str(gen.hf_dir)) == sum(e.stat().st_size for e in files)
    assert path_bytes(str(tmp_path / "nothing")) is None


def test_status_model_map_through_the_daemon(tmp_path):
    """A GGUF without a chat template: the daemon falls back to ChatML and says so."""
    spec = modelgen.SPECS["llama"]
    path = tmp_path / "no-template.gguf"
    modelgen.write_gguf(spec, modelgen.make_weights(spec), modelgen.build_tokenizer(spec), path,
                        "q8_0", chat_template="")
    with Daemon(tmp_path / "k.sock", model=str(path)) as d, d.client() as c:
        m = c.status()["model"]
    assert m["context_length"] == spec.max_pos and m["file_bytes"] == os.path.getsize(path)
    assert m["chat_template_source"] == "chatml fallback"
    assert m["weight_types"] == {"q8_0": 1.0} and m["vision"] is False
