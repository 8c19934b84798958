"""The engine's own paged forward reproduces the golden logits of every model family."""

import pytest
import torch
from safetensors.torch import load_file

from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine
from cover_vllm.scheduler.output import CanvasInput, SchedulerOutput, WorkItem
from golden_cases import GOLDEN

FAMILIES = ["llada", "dream", "llada_moe"]


def _item(i: int, ids: torch.Tensor, shift: int) -> WorkItem:
    """Row i of a batch: the whole canvas as the window, logits for every predictable row."""
    n = int(ids.numel())
    slots = torch.arange(n) + 64 * i                     # disjoint cache slots per sequence
    return WorkItem(f"r{i}", 0, [CanvasInput(ids, slots)], view_start=shift, view_end=n)


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_forward_matches_golden(family):
    golden = load_file(str(GOLDEN / family / "forward.safetensors"))
    engine = Engine(EngineConfig(model=str(GOLDEN / family / "model"), decoding="low_confidence",
                                 kv_cache="none"))
    shift = engine.spec.logit_shift
    ids, mask = golden["input_ids"], golden["attention_mask"].bool()
    # Unpadded rows against logits_nomask; the padded row with its pads stripped against `logits`
    # (pads are hidden keys and RoPE is relative, so a stripped prompt is the same computation).
    rows = [ids[0], ids[1], ids[2][mask[2]]]
    out = SchedulerOutput([_item(i, r, shift) for i, r in enumerate(rows)])
    logits = engine.executor.execute_model(out).logits        # row j predicts position j + shift
    expected = [golden["logits_nomask"][0], golden["logits_nomask"][1],
                golden["logits"][2][mask[2]]]
    for got, want in zip(logits, expected):
        want = want[: want.shape[0] - shift]                  # predictor rows 0..L-1-shift
        assert (got - want).abs().max().item() <= 1e-4
