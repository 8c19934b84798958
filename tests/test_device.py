"""The worker is device-true: everything the model and the attention backend touch is built on
the model's device, so the first GPU run is not the first test of it.

The engine runs with `device="meta"` (shapes only: no storage, no arithmetic; host copies of
the results are zeros) and every torch call made inside the model's `embed`, `forward_tokens`
(attention included) and `compute_logits` is checked: a tensor argument on any other device
(e.g. an index or mask the runner built on the CPU and forgot to move) fails the test. The
paths covered: plain windows, COVER's override views and statistics, the sparse windows of
adaptive refresh, classifier-free guidance, WINO's extra rows, ASRD's embedding edits, and a
Dream model's shifted predictor rows. (LLaDA-MoE's router counts tokens per expert, which a
shapes-only run cannot do.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from cover_vllm import LLM, SamplingParams

GOLDEN_DREAM = Path(__file__).parent / "fixtures" / "golden" / "dream" / "model"


class OnDevice(TorchFunctionMode):
    """Records every torch call that receives a tensor (of rank >= 1) on another device."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.calls, self.strays = device, 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type != self.device:
                self.strays.append((getattr(func, "__name__", str(func)), t.device, t.shape))
        return func(*args, **(kwargs or {}))


def _checked(llm: LLM) -> OnDevice:
    """Wrap the model's three entry points in an OnDevice check; returns the recorder."""
    model = llm.engine.executor.model
    check = OnDevice("meta")
    for name in ("embed", "forward_tokens", "compute_logits"):
        inner = getattr(model, name)

        def wrapped(*args, _inner=inner, **kwargs):
            with check:
                return _inner(*args, **kwargs)

        setattr(model, name, wrapped)
    return check


CASES = {
    "low_confidence": dict(decoding="low_confidence", kv_cache="dual"),
    "cover": dict(decoding="cover", kv_cache="dual"),
    "cover-adaptive": dict(decoding="cover", kv_cache="dual", cache_refresh="adaptive"),
    "cfg": dict(decoding="low_confidence", kv_cache="prefix",
                decoding_params={"cfg_scale": 1.0}),
    "wino": dict(decoding="wino", kv_cache="none"),
    "asrd": dict(decoding="asrd", kv_cache="none"),
}


@pytest.fixture(scope="module")
def meta_llm():
    return LLM("cover-tiny", device="meta", num_threads=1)


@pytest.mark.parametrize("case", list(CASES))
def test_runner_builds_every_model_input_on_the_model_device(meta_llm, case):
    check = _checked(meta_llm)
    params = SamplingParams(max_tokens=8, block_length=8, ignore_eos=True, **CASES[case])
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11]}]
    outs = meta_llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert check.calls > 100 and check.strays == []


def test_dream_runs_on_the_model_device():
    llm = LLM(str(GOLDEN_DREAM), device="meta", num_threads=1)
    check = _checked(llm)
    params = SamplingParams(max_tokens=8, block_length=8, ignore_eos=True, decoding="cover",
                            kv_cache="dual")
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
    assert check.calls > 100 and check.strays == []


def test_the_check_catches_a_stray_host_tensor(meta_llm):
    """The recorder is not vacuous: a CPU tensor handed to the model is reported."""
    check = OnDevice("meta")
    with check:
        meta_llm.engine.executor.model.embed(torch.tensor([1, 2, 3]))
    assert check.strays and check.strays[0][1].type == "cpu"
