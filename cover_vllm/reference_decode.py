"""The plain dense LLaDA reference decoding loop: batch 1, no KV cache, low-confidence remasking.

Written separately from the engine so it can serve as the benchmark's reference and as the
accuracy check of cover-tiny. It follows LLaDA's `generate` (Nie et al., 2025, "Large Language
Diffusion Models", Alg. 4 with low-confidence remasking) at temperature 0:

* the generation region of `gen_length` slots starts fully masked and is split into
  `num_blocks = gen_length / block_length` semi-autoregressive blocks, decoded left to right;
* each block gets `s = steps / num_blocks` steps; with `m` masked slots at the block's start,
  step i reveals floor(m / s) tokens, plus one more for the first (m mod s) steps
  (LLaDA's `get_num_transfer_tokens`);
* a step runs the full canvas through the model, predicts x0 = argmax of the logits, scores each
  position by the float32 softmax probability of that argmax, and commits the highest-scoring
  masked positions of the current block (other blocks' slots are never candidates).
Committed tokens are never revised. This is the slow oracle, not the engine's fast path.
"""

from __future__ import annotations

import torch


def num_transfer_tokens(num_masked: int, steps: int) -> list[int]:
    """Tokens revealed at each of `steps` steps for `num_masked` masked slots (LLaDA schedule)."""
    base, extra = divmod(num_masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def check_schedule(gen_length: int, block_length: int, steps: int) -> int:
    if gen_length <= 0 or block_length <= 0 or steps <= 0:
        raise ValueError(f"gen_length={gen_length}, block_length={block_length} and "
                         f"steps={steps} must all be positive")
    if gen_length % block_length:
        raise ValueError(f"gen_length={gen_length} must be a multiple of "
                         f"block_length={block_length}")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps={steps} must be a multiple of the number of blocks "
                         f"({num_blocks} = gen_length / block_length)")
    return num_blocks


def commit_low_confidence(logits: torch.Tensor, block: torch.Tensor, mask_id: int,
                          count: int) -> None:
    """One step's decision on a block: x0 = argmax of `logits` [n, V] (row j predicts block[j]),
    scored by the float32 softmax probability of that argmax; the `count` highest-scoring
    still-masked slots of `block` [n] (a view of the canvas) take their x0, in place."""
    probs = torch.softmax(logits.float(), dim=-1)
    confidence, x0 = probs.max(dim=-1)                                 # [n], [n]
    confidence = torch.where(block == mask_id, confidence,
                             torch.full_like(confidence, -float("inf")))
    chosen = torch.topk(confidence, count).indices
    block[chosen] = x0[chosen]


@torch.no_grad()
def reference_generate(model: torch.nn.Module, prompt_ids: list[int], gen_length: int,
                       block_length: int, steps: int, mask_id: int) -> list[int]:
    """Decode `gen_length` tokens after `prompt_ids`; returns the generated ids (EOS included).

    `model(input_ids[1, L])` must return logits [1, L, V] (no logit shift: row j predicts j).
    """
    num_blocks = check_schedule(gen_length, block_length, steps)
    steps_per_block = steps // num_blocks
    device = next(model.parameters()).device
    prompt_len = len(prompt_ids)
    canvas = torch.full((1, prompt_len + gen_length), mask_id, dtype=torch.long, device=device)
    canvas[0, :prompt_len] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    for block in range(num_blocks):
        start = prompt_len + block * block_length
        end = start + block_length
        num_masked = int((canvas[0, start:end] == mask_id).sum())
        for count in num_transfer_tokens(num_masked, steps_per_block):
            if count == 0:
                continue
            logits = model(canvas)[0]                                  # [L, V]
            commit_low_confidence(logits[start:end], canvas[0, start:end], mask_id, count)
    return canvas[0, prompt_len:].tolist()
