"""SwiGLU experts (LLaDA-MoE, LLaDA2.x: `mlp.experts.{e}` modules) laid out stacked on a device, so
a sparse MoE block runs as two grouped GEMMs with no host sync (issue #42).

`ExpertStack.build` re-points every expert's fused gate|up weight at a slice of one [E, 2M, H]
tensor and its down weight at a slice of one [E, H, M] tensor (the experts keep their names,
shapes and in-place loading, as `FusedLinears.fuse` does for one group), after
`fuse_projections` has fused each expert. `ExpertStack.__call__` is `StackedExperts.grouped`'s
recipe: the routed slots sorted by expert, the group ends found on the device (searchsorted),
`F.grouped_mm` twice, the weighted rows summed back per token. Nothing reads a value on the host.

Only off the CPU and unquantized: the CPU keeps the per-expert loop (its row counts cost nothing
to read there, and its oneDNN-packed expert weights could not be views of a stack), and a
quantized expert has no plain weight to stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExpertStack:
    """Two stacked weights: gate|up [E, 2M, H] and down [E, H, M] (rank-local under TP)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up, self.down = gate_up, down

    @classmethod
    @torch.no_grad()
    def build(cls, experts: nn.ModuleList, copy: bool) -> ExpertStack | None:
        """Stack the fused weights of `experts` (SwiGLUs already fused); None where they do not
        stack (CPU, quantized, biased, not fused)."""
        groups = [(e.gate_up, e.down) for e in experts]
        if any(g.quant is not None or g.packed is not None or g.weight is None
               or g.bias is not None for pair in groups for g in pair):
            return None
        if groups[0][0].weight.device.type == "cpu":
            return None
        stacks = []
        for j in (0, 1):
            parts = [pair[j].weight for pair in groups]
            stack = (torch.stack(parts) if copy else
                     parts[0].new_empty((len(parts), *parts[0].shape)))
            for pair, rows in zip(groups, stack):
                group = pair[j]
                group.weight = rows
                for i, lin in enumerate(group.linears):
                    lin.weight = nn.Parameter(group._part(rows, i), requires_grad=False)
            stacks.append(stack)
        return cls(*stacks)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                 accumulate: torch.dtype) -> torch.Tensor:
        """x [T, H], routing weights [T, k], expert ids [T, k] -> [T, H] in x.dtype, the
        weighted expert outputs summed in `accumulate` (the family's official dtype)."""
        k = chosen.shape[1]
        flat = chosen.reshape(-1)                                   # [T * k], token-major
        order = flat.argsort(stable=True)                           # slots grouped by expert
        token = order // k
        experts = torch.arange(self.gate_up.shape[0], device=x.device, dtype=flat.dtype)
        ends = torch.searchsorted(flat.index_select(0, order), experts, right=True).int()
        gate, up = F.grouped_mm(x.index_select(0, token), self.gate_up.transpose(1, 2),
                                offs=ends).chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)  # [T * k, H]
        slot_weight = weights.reshape(-1).index_select(0, order)[:, None]
        out = torch.zeros(x.shape, dtype=accumulate, device=x.device)
        return out.index_add_(0, token, y.to(accumulate) * slot_weight).to(x.dtype)


def uses_stack(stack: ExpertStack | None, x: torch.Tensor) -> bool:
    """Whether a block runs its stacked path for `x`: a stack exists and x is bf16 off the CPU
    (`F.grouped_mm`'s CUDA kernel takes bf16; the meta device stands for it)."""
    return stack is not None and x.device.type != "cpu" and x.dtype == torch.bfloat16
