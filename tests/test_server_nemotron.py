"""Nemotron-Labs-Diffusion behind the OpenAI-compatible server: the three decodings (and the
default, `nemotron`) answer completions with the offline tokens, and /metrics reports the
self-speculation acceptance."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from golden_cases import GOLDEN  # noqa: E402
from serve_helpers import start_server  # noqa: E402

from cover_vllm import LLM, SamplingParams  # noqa: E402

DIR = str(GOLDEN / "nemotron" / "model_long")
PROMPT = [1, 40, 36, 97, 155, 110, 33, 21, 89, 57, 141, 28]


def test_three_decodings_served_and_acceptance_in_metrics():
    srv = start_server(DIR, decoding=None, dtype="float32", kv_cache_memory_bytes=8 << 20)
    try:
        llm = LLM(DIR, dtype="float32", kv_cache_memory_bytes=8 << 20)
        client = openai.OpenAI(api_key="unused", base_url=srv.url + "/v1", max_retries=0,
                               timeout=120)
        for decoding in (None, "nemotron", "ar", "linear_spec"):
            extra = {"block_length": 4} | ({} if decoding is None else {"decoding": decoding})
            got = client.completions.create(model="test-model", prompt=PROMPT, max_tokens=16,
                                            temperature=0.0, extra_body=extra)
            want = llm.generate(PROMPT, SamplingParams(max_tokens=16, block_length=4,
                                                       decoding=decoding), use_tqdm=False)[0]
            assert got.usage.completion_tokens == len(want.outputs[0].token_ids), decoding
        text = httpx.get(srv.url + "/metrics").text
        lines = [ln for ln in text.splitlines() if ln.startswith("cover_vllm_spec_")]
        verifies = sum(float(ln.split()[-1]) for ln in lines
                       if ln.startswith("cover_vllm_spec_verifies_total"))
        length = [float(ln.split()[-1]) for ln in lines
                  if ln.startswith("cover_vllm_spec_acceptance_length")]
        assert verifies >= 1 and length and 1.0 <= length[0] <= 4.0
    finally:
        srv.stop()
