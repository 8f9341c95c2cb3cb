"""Shared fixtures: the generated models (written once per session into a tmp dir),
Hugging Face transformers running them (loaded once per session), and the matmul kernels'
VNNI switch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from modelgen import GeneratedModel, generate


class ModelZoo:
    """Generated models by name, each written on first use (HF dir + Q8_0 and F16 GGUF)."""

    def __init__(self, root: Path):
        self.root = root
        self._models: dict[str, GeneratedModel] = {}

    def get(self, name: str) -> GeneratedModel:
        if name not in self._models:
            self._models[name] = generate(name, self.root, tensor_types=("q8_0", "f16"))
        return self._models[name]


class Transformers:
    """transformers (CPU torch, float32, eager attention) on the generated HF dirs."""

    def __init__(self, zoo: ModelZoo):
        import torch
        torch.set_num_threads(2)
        self.torch = torch
        self.zoo = zoo
        self._models = {}

    def model(self, name: str):
        if name not in self._models:
            from transformers import AutoModelForCausalLM
            self._models[name] = AutoModelForCausalLM.from_pretrained(
                str(self.zoo.get(name).hf_dir), dtype=self.torch.float32,
                attn_implementation="eager").eval()
        return self._models[name]

    def logits(self, name: str, ids) -> np.ndarray:
        """Logits (n, vocab) float64 of one forward pass over ids."""
        with self.torch.no_grad():
            out = self.model(name)(self.torch.tensor([list(ids)]))
        return out.logits[0].double().numpy()

    def greedy(self, name: str, ids, n_new: int) -> list[int]:
        """Greedy continuation by incremental decoding with transformers' own KV cache
        (EOS does not stop it)."""
        m, torch = self.model(name), self.torch
        out_ids = []
        with torch.no_grad():
            out = m(torch.tensor([list(ids)]), use_cache=True)
            for _ in range(n_new):
                nxt = int(out.logits[0, -1].argmax())
                out_ids.append(nxt)
                out = m(torch.tensor([[nxt]]), cache=out.cache, use_cache=True)
        return out_ids


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> ModelZoo:
    return ModelZoo(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def hf(zoo) -> Transformers:
    return Transformers(zoo)


@pytest.fixture(params=[True, False], ids=["vnni-if-any", "no-vnni"])
def vnni(request):
    """Runs a test with the AVX512 paths (VNNI prefill tiles, 16-float attention) on (where
    the CPU has them) and off; once on other CPUs, which have no such switch. Both kernel
    modules, the daemon's and the per-op one, are switched: each has its own copy of the C."""
    from kestreld.kernels import K, ops
    if not request.param and K.simd_path() != "avx2":
        pytest.skip("no VNNI switch on this CPU: the run with it on covers the path")
    on = K.set_matmul_vnni(request.param)
    assert ops().set_matmul_vnni(request.param) == on
    yield on
    K.set_matmul_vnni(True)
    ops().set_matmul_vnni(True)


# The HTTP tests' clients of the module's `daemon` (started with --http 127.0.0.1:0)
@pytest.fixture
def http(daemon):
    import httpx
    with httpx.Client(base_url=daemon.http_url, timeout=120) as c:
        yield c


@pytest.fixture
def sdk(daemon):
    import openai
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c
