"""Stacked SwiGLU experts (cover_vllm/layers/expert_stack.py, issue #42): the grouped path of
LLaDA-MoE's and LLaDA2.x's sparse blocks equals their per-expert loop, and the stack is built
(experts re-pointed at its slices) off the CPU only."""

from __future__ import annotations

import pytest
import torch

from cover_vllm.layers.common import fuse_projections
from cover_vllm.layers.expert_stack import ExpertStack, uses_stack
from cover_vllm.models.configs import LLADA2_MINI
from cover_vllm.models.llada2 import LLaDA2SparseMoE
from cover_vllm.models.llada_moe import SparseMoE

HIDDEN = 64
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "expert_intermediate_size": 32}
LLADA2 = {**LLADA2_MINI, "num_experts": 16, "n_group": 4, "topk_group": 2,
          "num_experts_per_tok": 4, "moe_intermediate_size": 32}


def _block(kind: str, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        block = SparseMoE(MOE, HIDDEN) if kind == "llada-moe" else LLaDA2SparseMoE(LLADA2, HIDDEN)
    if device != "meta":
        for p in block.parameters():
            p.data.normal_(0, 0.2)
    return block.to(torch.bfloat16)


def _stack_of(block) -> ExpertStack:
    """The stack a device would build, made by hand on the CPU (where `build` declines)."""
    return ExpertStack(torch.stack([e.gate_up.weight for e in block.experts]),
                       torch.stack([e.down.weight for e in block.experts]))


@pytest.mark.parametrize("kind", ["llada-moe", "llada2"])
def test_grouped_experts_equal_the_loop(kind):
    block = _block(kind)
    fuse_projections(block)
    assert block.stack is None                  # the CPU keeps its loop
    x = torch.randn(37, HIDDEN).to(torch.bfloat16)
    loop = block(x)
    if kind == "llada-moe":
        weights, chosen = block.route(x)
        grouped = _stack_of(block)(x, weights, chosen, x.dtype)
    else:
        weights, chosen = block.gate(x)
        grouped = _stack_of(block)(x, weights, chosen, torch.float32) + block.shared_experts(x)
    torch.testing.assert_close(grouped.float(), loop.float(), atol=2e-2, rtol=2e-2)
    if kind == "llada2":                        # fp32 sums: the same bits as the loop
        assert torch.equal(grouped, loop)


@pytest.mark.parametrize("kind", ["llada-moe", "llada2"])
def test_the_stack_holds_every_expert_off_the_cpu(kind):
    block = _block(kind, "meta")
    fuse_projections(block, copy=False)
    stack = block.stack
    assert stack is not None and stack.gate_up.shape[0] == len(block.experts)
    x = torch.empty(5, HIDDEN, dtype=torch.bfloat16, device="meta")
    assert uses_stack(stack, x) and not uses_stack(stack, x.float())
    for e, expert in enumerate(block.experts):
        for lin in (expert.gate_proj, expert.up_proj):
            assert lin.weight.untyped_storage()._cdata == stack.gate_up.untyped_storage()._cdata
        assert expert.gate_up._fused() and expert.down.weight.shape == stack.down[e].shape
    assert block(x).shape == x.shape
