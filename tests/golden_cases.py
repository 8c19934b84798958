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
    """The engine's output ids per prompt. LLaDA2.x references return the generated part already
    cut after the first EOS; SDAR's returns its whole canvas (prompt, every block through the
    stop, [MASK]s after it, the last block's slots past max_tokens): its first max_tokens
    generated slots, cut after the first stop id, are what the engine returns."""
    if case.get("output_includes_prompt") is False:
        return case["output_ids"]
    width = len(case["prompt_ids"][0])
    if not case["decoder"].startswith("sdar_"):
        return [row[width:] for row in case["output_ids"]]
    stops = set(case["params"]["stopping_criteria_idx"] or [])
    out = []
    for row in case["output_ids"]:
        gen = row[width: width + case["params"]["gen_length"]]
        cut = next((i for i, t in enumerate(gen) if t in stops), None)
        out.append(gen if cut is None else gen[: cut + 1])
    return out


def expected_nfe(case: dict) -> int:
    """Forwards that decide tokens: SDAR's denoising calls (its prefill and per-block store-KV
    calls are the engine's prefill and commit rows), every model call elsewhere."""
    return case.get("nfe_denoising", case["nfe"])


def expected_finish(case: dict, tokens: list[int]) -> str:
    """'stop' when the output ends at a stop id (or at the EOS, unless ignore_eos)."""
    params = sampling_params(case)
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.add(case["params"]["eos_id"])
    return "stop" if tokens and tokens[-1] in stops else "length"


def sampling_params(case: dict) -> SamplingParams:
    """The engine request equivalent to the reference call (ignore_eos: the non-block references
    don't stop; the block families: `block_sampling_params`)."""
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
    if decoder in BLOCK_DECODERS:
        return block_sampling_params(case)
    raise KeyError(f"no engine mapping for decoder {decoder!r} yet")


def without_early_stop(case: dict) -> dict:
    """An `_eos_` case run with eos_early_stop off: the same tokens, `nfe_without_early_stop`
    model calls (golden README: LLaDA2.0 then stops at the end of the EOS's block, LLaDA2.1
    generates every block)."""
    params = dict(case["params"], eos_early_stop=False)
    return dict(case, name=case["name"] + "_no_early_stop", params=params,
                nfe=case["nfe_without_early_stop"])


BLOCK_DECODERS = ("llada2_generate", "llada21_generate", "sdar_block_diffusion_generate",
                  "sdar_block_diffusion_generate_argmax")


def block_sampling_params(case: dict) -> SamplingParams:
    """LLaDA2.x and SDAR cases (golden README, "Block-diffusion families"). Their `steps` are per
    block (the decoders read them so). LLaDA2.x: greedy, EOS = the model's (eos_id), so
    ignore_eos stays False: 2.0 stops at the end of a block holding an EOS, 2.1 only with
    eos_early_stop (the strategy's `eos_ends_request`); both outputs are cut after the first EOS.
    SDAR: `stopping_criteria_idx` are stop_token_ids, nothing else stops it (ignore_eos). Its
    official cases sample with top_k=1, where every confidence is 1.0: `sequential` is the
    argmax; `low_confidence_dynamic` commits every [MASK] at once, which is threshold 0 at
    temperature 0. The `_argmax` cases are greedy with the model's probabilities."""
    p, decoder = case["params"], case["decoder"]
    if decoder.startswith("llada2"):
        assert p["temperature"] == 0 and p["top_p"] is None and p["top_k"] is None, case["name"]
        knobs = {"threshold": p["threshold"], "eos_early_stop": p["eos_early_stop"]}
        if decoder == "llada2_generate":
            name, knobs["minimal_topk"] = "llada2", p["minimal_topk"]
        else:
            name = "llada2_edit"
            knobs.update({k: p[k] for k in ("editing_threshold", "max_post_steps",
                                            "num_to_transfer")})
        return SamplingParams(max_tokens=p["gen_length"], block_length=p["block_length"],
                              steps=p["steps"], temperature=0.0, decoding=name,
                              decoding_params=knobs)
    official = decoder == "sdar_block_diffusion_generate"
    assert (p["top_k"], p["temperature"]) == ((1, 1.0) if official else (0, 0.0)), case["name"]
    assert p["top_p"] == 1.0 and p["eb_threshold"] is None, case["name"]
    rule = p["remasking_strategy"]
    threshold = 0.0 if official and rule == "low_confidence_dynamic" else p["confidence_threshold"]
    return SamplingParams(max_tokens=p["gen_length"], block_length=p["block_length"],
                          steps=p["denoising_steps"], temperature=0.0,
                          stop_token_ids=list(p["stopping_criteria_idx"] or []), ignore_eos=True,
                          decoding="sdar", decoding_params={"remasking": rule,
                                                            "threshold": threshold})


def check_alone(llm, case: dict) -> list:
    """Each prompt of `case` alone: tokens and NFE equal the reference's; returns the outputs."""
    outs = []
    for prompt, expect in zip(real_prompts(case), expected_tokens(case)):
        (out,) = llm.generate([prompt], sampling_params(case), use_tqdm=False)
        assert out.outputs[0].token_ids == expect
        assert out.metrics.nfe == expected_nfe(case)
        assert out.outputs[0].finish_reason == expected_finish(case, expect)
        outs.append(out)
    return outs


def check_batched(llm, cases: list[dict]) -> list:
    """Every prompt of every case in ONE generate call; tokens and NFE per request as alone."""
    prompts, params, expect, nfe, finish = [], [], [], [], []
    for case in cases:
        for prompt, tokens in zip(real_prompts(case), expected_tokens(case)):
            prompts.append(prompt)
            params.append(sampling_params(case))
            expect.append(tokens)
            nfe.append(expected_nfe(case))
            finish.append(expected_finish(case, tokens))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expect
    assert [o.metrics.nfe for o in outs] == nfe
    assert [o.outputs[0].finish_reason for o in outs] == finish
    return outs
