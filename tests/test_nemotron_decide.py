"""The batched decisions of Nemotron-Labs-Diffusion's decodings (strategies/nemotron_decide.py)
against their slow references: each request's picks and confidences as the per-request code
computed them (argmax, float64 Gumbel-max from its own generator, softmax of the pick), and the
host-side selection rules as torch computes them (top-k, float32 thresholds)."""

import math
import random

import torch

from cover_vllm.host_transfer import HostTransfer
from cover_vllm.models.nemotron_cache import PieceLogits
from cover_vllm.strategies.nemotron import (ARLoop, ARParams, BlockLoop, Job, NemotronParams,
                                            float32, top_k)
from cover_vllm.strategies.nemotron_decide import decide


def _reference(logits: torch.Tensor, temperature: float, generator) -> tuple[list, list]:
    """The per-request pick and confidence (the code before the batched decisions)."""
    if temperature <= 0:
        tokens = logits.argmax(-1)
    else:
        noise = torch.rand(logits.shape, dtype=torch.float64, generator=generator)
        tokens = (logits.double().exp() / (-noise.log()) ** temperature).argmax(-1)
    conf = torch.softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), conf.tolist()


def test_batched_picks_equal_each_requests_own():
    torch.manual_seed(0)
    temps, sizes = [0.0, 0.7, 1.3, 0.0], [4, 1, 4, 0]
    flat = torch.randn(sum(sizes), 50) * 3
    loops = []
    for i, (t, size) in enumerate(zip(temps, sizes)):
        job = Job([1, 2], 8, 4, 49, (11,), temperature=t, seed=10 + i)
        loop = BlockLoop(job, NemotronParams()) if size == 4 else ARLoop(job, ARParams())
        loop.phase = "denoise" if size == 4 else "prefill"
        loops.append(loop)
    for _ in range(2):                  # the second step draws on from each generator
        picks = decide(PieceLogits(flat, sizes), loops, HostTransfer())
        start = 0
        for loop, size, pick in zip(loops, sizes, picks):
            rows = flat[start:start + size]
            gen = None
            if loop.job.temperature > 0:
                gen = getattr(loop, "_ref_gen", None) or torch.Generator().manual_seed(
                    loop.job.seed)
                loop._ref_gen = gen
            tokens, conf = _reference(rows, loop.job.temperature, gen) if size else ([], [])
            assert pick.tokens == tokens
            if loop.wants_confidence:
                assert pick.confidence == conf
            else:
                assert pick.confidence is None
            start += size


def test_top_k_chooses_what_torch_topk_chooses():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.choice([4, 8, 32])
        scores = [rng.choice([1.0, 0.5, 0.25, 0.125, -math.inf]) for _ in range(n)]
        finite = sum(s > -math.inf for s in scores)
        if not finite:
            continue
        k = rng.randint(1, finite)
        want = torch.topk(torch.tensor(scores, dtype=torch.float32), k).indices.tolist()
        assert sorted(top_k(scores, k)) == sorted(want)


def test_thresholds_compare_in_float32_as_torch_does():
    conf = torch.tensor([0.8999999761581421, 0.9000000357627869, 0.5], dtype=torch.float32)
    want = (conf >= 0.9).tolist()
    assert [c >= float32(0.9) for c in conf.tolist()] == want == [True, True, False]
