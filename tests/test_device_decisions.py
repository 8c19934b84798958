"""Decisions are made on the logits' device: only O(rows) values cross to the host, once a step.

The engine runs the LLaDA-8B and SDAR-8B shapes (and DiffusionGemma-26B-A4B with its
`diffusion_gemma` decoder) on the "meta" device (shapes only, no storage:
the model's arithmetic and every decoder's run there for free) while a TorchDispatchMode watches
every aten op of each engine step. What runs on the host is then exactly the engine's host work,
and for every decoder at batch 8, with logprobs on:

* no host tensor holds a quarter of the vocabulary or more,
* the host tensors a step creates hold fewer than two vocabularies of elements in all,
* a step makes at most two device-to-host copies, at batch 1 as at batch 8.

Sizes are counted in 4-byte words, the size of one fp32 logit (an int64 counts two, a bool a
quarter): the one copy carries its tensors packed into one float64 buffer (host_transfer.py),
which an element count would not see in its true size.

The device path of every decoder is also run on the CPU (`dense_rows`: every view row read, as on
a GPU) and must decide exactly as the CPU's compact path does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cover_vllm import LLM, SamplingParams
from cover_vllm.strategies import STRATEGIES

DECODERS = sorted(STRATEGIES)


class HostWork(TorchDispatchMode):
    """Per aten op: the CPU tensors it makes (size and count; views and in-place results make
    none) and whether it copies from the device to the host (a non-CPU tensor in, a new CPU
    tensor out)."""

    def __init__(self):
        super().__init__()
        self.largest, self.elements, self.copies, self.ops = 0, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(r.alias_info is not None for r in func._schema.returns):
            outs = []                 # a view or an in-place result: no new host memory
        host = [t for t in outs if t.device.type == "cpu"]
        for t in host:
            words = -(-t.numel() * t.element_size() // 4)
            self.largest = max(self.largest, words)
            self.elements += words
            self.ops.append((str(func), tuple(t.shape), t.dtype))
        if host and any(t.device.type != "cpu" for t in ins):
            self.copies += 1
        return out


def _steps(llm: LLM, decoding: str, batch: int,
           params: SamplingParams | None = None) -> list[HostWork]:
    """Every engine step of a batch of `batch` requests, each watched."""
    engine = llm.engine
    params = params or SamplingParams(max_tokens=32, block_length=32, ignore_eos=True,
                                      decoding=decoding, logprobs=3)
    for i in range(batch):
        engine.add_request(f"{decoding}-{batch}-{i}",
                           {"prompt_token_ids": [5 + i % 7] * (60 + i)}, params)
    steps = []
    while engine.has_unfinished_requests():
        with HostWork() as work:
            engine.step()
        steps.append(work)
        assert len(steps) < 200, "the dry run does not end"
    return steps


@pytest.fixture(scope="module", params=["llada-8b", "sdar-8b"])
def meta_llm(request):
    return LLM(request.param, load_format="dummy", device="meta", num_threads=1,
               kv_cache_memory_bytes=4 << 30, max_num_seqs=8)


@pytest.mark.parametrize("decoding", DECODERS)
def test_a_step_moves_only_decisions_to_the_host(meta_llm, decoding):
    vocab = meta_llm.engine.spec.vocab_size
    for batch in (1, 8):
        steps = _steps(meta_llm, decoding, batch)
        assert steps, "no step ran"
        for i, work in enumerate(steps):
            biggest = max(work.ops, key=lambda o: torch.Size(o[1]).numel(), default=None)
            assert work.largest < vocab // 4, (decoding, batch, i, biggest)
            assert work.elements < 2 * vocab, (decoding, batch, i, work.elements)
            assert work.copies <= 2, (decoding, batch, i, work.copies)
        assert any(w.copies >= 1 for w in steps)          # the decisions did cross


def _check_steps(steps: list[HostWork], vocab: int, what) -> None:
    assert steps, "no step ran"
    for i, work in enumerate(steps):
        biggest = max(work.ops, key=lambda o: torch.Size(o[1]).numel(), default=None)
        assert work.largest < vocab // 4, (what, i, biggest, work.largest)
        assert work.elements < 2 * vocab, (what, i, work.elements)
        assert work.copies <= 2, (what, i, work.copies)
    assert any(w.copies >= 1 for w in steps)              # the decisions did cross


def test_a_diffusion_gemma_step_moves_only_decisions_to_the_host():
    """The released 26B-A4B shape (262,144 tokens; int4, as it must be to fit this host's
    memory plan: the decisions do not depend on the weights), two canvases of 256 per request
    with logprobs, at batch 1 and 8: the [n, 256, V] logits, self-conditioning and every draw
    stay on the device; a step copies the decisions (plus, in a step that admits requests,
    their first canvases). The MoE runs its device path (grouped GEMMs, no host sync)."""
    llm = LLM("diffusion-gemma-26b-a4b", load_format="dummy", device="meta",
              quantization="int4", num_threads=1, kv_cache_memory_bytes=4 << 30, max_num_seqs=8)
    vocab = llm.engine.spec.vocab_size
    assert vocab == 262144
    params = SamplingParams(max_tokens=512, logprobs=3,
                            decoding_params={"max_denoising_steps": 2})
    for batch in (1, 8):
        steps = _steps(llm, "diffusion_gemma", batch, params)
        assert len(steps) == 4                       # 2 canvases x 2 steps, every request
        _check_steps(steps, vocab, ("diffusion_gemma", batch))


def test_the_watch_sees_a_copy_and_a_large_host_tensor():
    """The recorder is not vacuous."""
    with HostWork() as work:
        x = torch.zeros(4, 5, device="meta")
        torch.empty_like(x, device="cpu").zero_()
        torch.zeros(1000)[:10]
        torch.zeros(8, dtype=torch.uint8)
    assert work.copies == 1 and work.largest == 1000 and work.elements == 1022


def test_the_grammar_mask_off_the_cpu_is_xgrammar_s():
    """The frontier mask a GPU applies (the bitmask unpacked on the device) allows exactly the
    tokens xgrammar's CPU kernel allows."""
    import xgrammar as xgr

    from cover_vllm.structured_output.constraint import allowed_tokens

    vocab = 1000
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (1, (vocab + 31) // 32), dtype=torch.int32,
                            generator=gen)
    row = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(row, bitmask)
    allowed = allowed_tokens(bitmask, vocab, torch.device("cpu"))
    assert torch.equal(allowed, torch.isfinite(row[0]))
    assert 0 < int(allowed.sum()) < vocab


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("cover-tiny", kv_cache="dual", num_threads=1)


@pytest.mark.parametrize("decoding", DECODERS)
def test_the_device_path_gives_the_cpu_s_tokens(tiny_llm, decoding):
    """cover-tiny end to end, every view row read as on a GPU (`dense_rows`), with logprobs and
    sampling: the same tokens, NFE and logprobs as the CPU's path."""
    from cover_vllm.strategies.sampling import dense_rows

    llm = tiny_llm
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 8], [9, 10], [11, 12, 13])]
    params = [SamplingParams(max_tokens=16, block_length=8, decoding=decoding, logprobs=2,
                             seed=s, temperature=t) for s, t in ((0, 0.0), (1, 0.8))]
    for sp in params:
        want = llm.generate(prompts, sp, use_tqdm=False)
        with dense_rows():
            got = llm.generate(prompts, sp, use_tqdm=False)
        for a, b in zip(want, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.metrics.nfe == b.metrics.nfe
            assert a.outputs[0].logprobs == b.outputs[0].logprobs

