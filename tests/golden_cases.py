"""Turn ../shared/golden generate.json cases into engine requests (shared by the golden tests)."""

from __future__ import annotations

import json
from pathlib import Path

from cover_vllm import SamplingParams

GOLDEN = Path(__file__).parent / "fixtures" / "golden"


def load_cases(family: str, decoders: tuple[str, ...]) -> list[dict]:
    cases = json.loads((GOLDEN / family / "generate.json").read_text())
    return [c for c in cases if c["decoder"] in decoders]


def real_prompts(case: dict) -> list[dict]:
    """Each prompt row with its left pads stripped (pads are hidden keys; RoPE is relative)."""
    mask = case.get("attention_mask")
    rows = case["prompt_ids"]
    return [{"prompt_token_ids": [t for j, t in enumerate(row) if not mask or mask[i][j]]}
            for i, row in enumerate(rows)]


def expected_tokens(case: dict) -> list[list[int]]:
    width = len(case["prompt_ids"][0])
    return [row[width:] for row in case["output_ids"]]


def sampling_params(case: dict) -> SamplingParams:
    """The engine request equivalent to the reference call (ignore_eos: the references don't stop)."""
    p, decoder = case["params"], case["decoder"]
    if decoder == "llada_generate":
        return SamplingParams(max_tokens=p["gen_length"], block_length=p["block_length"],
                              steps=p["steps"], ignore_eos=True, decoding=p["remasking"],
                              decoding_params={"cfg_scale": p["cfg_scale"]})
    if decoder == "fastdllm_generate":
        return SamplingParams(max_tokens=p["gen_length"], block_length=p["block_length"],
                              steps=p["steps"], ignore_eos=True, decoding="threshold",
                              decoding_params={"threshold": p["threshold"]})
    if decoder == "dream_diffusion_generate":   # the reference has no blocks: one block
        return SamplingParams(max_tokens=p["max_new_tokens"], block_length=p["max_new_tokens"],
                              steps=p["steps"], ignore_eos=True, decoding=p["alg"],
                              decoding_params={"eps": p["eps"], "alg_temp": p["alg_temp"]})
    if decoder == "fastdllm_dream_threshold":
        return SamplingParams(max_tokens=p["max_new_tokens"], block_length=p["max_new_tokens"],
                              steps=p["steps"], ignore_eos=True, decoding="threshold",
                              decoding_params={"threshold": p["threshold"]})
    if decoder == "saber_generate":
        return SamplingParams(max_tokens=p["gen_length"], block_length=p["block_length"],
                              ignore_eos=True, decoding="saber", decoding_params={"n": p["n"]})
    if decoder == "saber_dream":   # no blocks (default: one); `steps` only sizes the time grid
        return SamplingParams(max_tokens=p["max_new_tokens"], steps=p["steps"], ignore_eos=True,
                              decoding="saber", decoding_params={"eos_penalty": p["eos_penalty"]})
    if decoder == "wino_decoding":
        return SamplingParams(max_tokens=p["gen_length"], block_length=p["block_length"],
                              temperature=p["temperature"], ignore_eos=True, decoding="wino",
                              decoding_params={"threshold": p["threshold"],
                                               "threshold_back": p["threshold_back"]})
    raise KeyError(f"no engine mapping for decoder {decoder!r} yet")


def check_alone(llm, case: dict) -> list:
    """Each prompt of `case` alone: tokens and NFE equal the reference's; returns the outputs."""
    outs = []
    for prompt, expect in zip(real_prompts(case), expected_tokens(case)):
        (out,) = llm.generate([prompt], sampling_params(case), use_tqdm=False)
        assert out.outputs[0].token_ids == expect
        assert out.metrics.nfe == case["nfe"]
        assert out.outputs[0].finish_reason == "length"
        outs.append(out)
    return outs


def check_batched(llm, cases: list[dict]) -> list:
    """Every prompt of every case in ONE generate call; tokens and NFE per request as alone."""
    prompts, params, expect, nfe = [], [], [], []
    for case in cases:
        for prompt, tokens in zip(real_prompts(case), expected_tokens(case)):
            prompts.append(prompt)
            params.append(sampling_params(case))
            expect.append(tokens)
            nfe.append(case["nfe"])
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expect
    assert [o.metrics.nfe for o in outs] == nfe
    return outs
