"""A small random-weight Qwen3 embedding model, written the way Qwen3-Embedding ships:

- HF dir: what sentence-transformers saves from Qwen3Model: config.json (Qwen3ForCausalLM,
  tied), model.safetensors with Qwen3Model's tensor names (no "model." prefix, no lm_head),
  tokenizer.json whose post-processor appends <|endoftext|> (TemplateProcessing), and
  modules.json + 1_Pooling/config.json (last-token pooling) + 2_Normalize.
- GGUF: llama.cpp's converter's layout (tests/modelgen.py) without output.weight, with
  `qwen3.pooling_type` = LAST (3), add_eos_token and EOS = <|endoftext|>.

`generate_reranker` writes a Qwen3-Reranker-style model the way llama.cpp's converter does:
a GGUF with `qwen3.pooling_type` = RANK, `cls.output.weight` (the output matrix's rows of the
two answer tokens, "yes" first) and `tokenizer.chat_template.rerank`; and its plain HF dir
(Qwen3ForCausalLM, for transformers). The generated tokenizer has no "yes" / "no" tokens:
two of its ordinary tokens stand in (RERANK_TOKENS).

Run `python tests/modelgen_embed.py OUT_DIR` to write them for manual use.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import gguf
from safetensors.numpy import save_file
from tokenizers import processors

import modelgen
from modelgen import GeneratedModel, ModelSpec

SPEC = ModelSpec("qwen3_embed", "qwen3", hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
                 head_dim=32, ffn=192, vocab=512, tied=True, seed=21)
END = "<|endoftext|>"
POOLING_CONFIG = {"word_embedding_dimension": SPEC.hidden, "pooling_mode_cls_token": False,
                  "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                  "pooling_mode_mean_sqrt_len_tokens": False,
                  "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True,
                  "include_prompt": True}
MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize"}]


def write_hf_dir(model: GeneratedModel, out_dir: Path) -> None:
    """The sentence-transformers directory of `model` (see the module docstring)."""
    tok = model.tokenizer
    modelgen.write_hf_dir(SPEC, model.weights, tok, out_dir)
    bare = {k.removeprefix("model."): v for k, v in model.weights.items()}
    save_file(bare, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    end_id = tok.tokenizer.token_to_id(END)
    tok.tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {END}:0", pair=f"$A:0 {END}:0 $B:1 {END}:1", special_tokens=[(END, end_id)])
    tok.tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "modules.json").write_text(json.dumps(MODULES, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(POOLING_CONFIG, indent=2))
    (out_dir / "2_Normalize").mkdir(exist_ok=True)


def _embedding_metadata(w: gguf.GGUFWriter) -> None:
    w.add_pooling_type(gguf.PoolingType.LAST)
    w.add_add_eos_token(True)


RERANK_SPEC = replace(SPEC, name="qwen3_rerank", seed=22)
RERANK_TOKENS = (300, 301)          # ids standing for "yes", "no"
# no special tokens: llama-cpp-python's `embed` tokenizes them as text (tests compare with it)
RERANK_TEMPLATE = "<Query>: {query}\n<Document>: {document}\nRelevant:"


def generate_reranker(out_root: Path) -> GeneratedModel:
    """Write the reranker under out_root/qwen3_rerank/ (HF dir `hf/`, `model-q8_0.gguf`)."""
    spec = RERANK_SPEC
    root = Path(out_root) / spec.name
    weights = modelgen.make_weights(spec)
    tok = modelgen.build_tokenizer(spec)
    cfg = modelgen.write_hf_dir(spec, weights, tok, root / "hf")
    model = GeneratedModel(spec, cfg, weights, tok, root / "hf")

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_string("tokenizer.chat_template.rerank", RERANK_TEMPLATE)
    head = weights["model.embed_tokens.weight"][list(RERANK_TOKENS)]
    model.gguf["q8_0"] = root / "model-q8_0.gguf"
    modelgen.write_gguf(spec, weights, tok, model.gguf["q8_0"], "q8_0", extra=metadata,
                        extra_tensors={"cls.output.weight": head})
    return model


def generate(out_root: Path, tensor_types=("q8_0",)) -> GeneratedModel:
    """Write the model under out_root/qwen3_embed/ (HF dir `hf/`, `model-<type>.gguf`)."""
    root = Path(out_root) / SPEC.name
    weights = modelgen.make_weights(SPEC)
    tok = modelgen.build_tokenizer(SPEC)
    model = GeneratedModel(SPEC, modelgen.hf_config(SPEC, tok), weights, tok, root / "hf")
    write_hf_dir(model, model.hf_dir)
    file_tok = replace(tok, eos_id=tok.tokenizer.token_to_id(END))
    for tt in tensor_types:
        path = root / f"model-{tt}.gguf"
        modelgen.write_gguf(SPEC, weights, file_tok, path, tt, extra=_embedding_metadata)
        model.gguf[tt] = path
    return model


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/modelgen_embed.py OUT_DIR")
    m = generate(Path(sys.argv[1]), tensor_types=("f32", "q8_0", "q4_0"))
    print(m.hf_dir, *m.gguf.values())
    r = generate_reranker(Path(sys.argv[1]))
    print(r.hf_dir, *r.gguf.values())
