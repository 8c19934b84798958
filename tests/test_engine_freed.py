"""An engine is freed as soon as its last reference goes (`del llm`), without waiting for the
garbage collector: no reference cycle through the engine, its runner or its model, and no
module-level object keeping one. A cycle would keep the weights and the KV pool until a full
collection, which a long-lived process (the test suite: 8 GB, issue #52) may not run for
thousands of allocations."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from cover_vllm import LLM, SamplingParams
from golden_cases import GOLDEN

NEMOTRON = dict(model=str(GOLDEN / "nemotron" / "model_long"), dtype="float32",
                kv_cache_memory_bytes=8 << 20)
CASES = {
    "cover-tiny": (dict(model="cover-tiny"), {}),
    "llada-dual": (dict(model=str(GOLDEN / "llada" / "model"), kv_cache="dual"),
                   dict(block_length=4)),
    "dream": (dict(model=str(GOLDEN / "dream" / "model")), dict(block_length=4)),
    "diffusion_gemma": (dict(model=str(GOLDEN / "diffusion_gemma" / "model")), {}),
    "nemotron-dual": (dict(NEMOTRON, kv_cache="dual"), {}),
    "nemotron-ar": (NEMOTRON, dict(decoding="ar")),          # the causal side's runner built
}


@pytest.mark.parametrize("name", CASES)
def test_del_frees_the_engine_without_a_collection(name) -> None:
    options, knobs = CASES[name]
    gc.disable()
    try:
        llm = LLM(**options)
        llm.generate([{"prompt_token_ids": [1, 11, 42, 7, 99]}] * 2,
                     SamplingParams(max_tokens=8, **knobs), use_tqdm=False)
        engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.executor.model)
        del llm
        assert engine() is None and model() is None, "a reference cycle keeps the engine"
    finally:
        gc.enable()


BUILD_ALL = """
import sys
from cover_vllm import LLM
for path in sys.argv[1:]:
    LLM(path)
print("torch._dynamo" in sys.modules)
"""


def test_building_models_imports_no_dynamo() -> None:
    """Building on meta runs no Python reference op: their first use imports torch._dynamo
    (143 MiB resident), and that import's frames kept the engine being built alive for good."""
    paths = [str(GOLDEN / family / "model") for family in
             ("llada", "dream", "sdar", "llada2", "llada_moe", "diffusion_gemma")]
    paths.append(NEMOTRON["model"])
    done = subprocess.run([sys.executable, "-c", BUILD_ALL, *paths], capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
