"""A reference driver for block-causal decoding: the official block loop, no engine, no cache.

Runs requests through a registered strategy the way the engine's contract says it will (one
forward per decision over the canvas prefix up to the current block's end with the block-causal
query x key mask, exactly as the official LLaDA2 `generate` calls its model; SDAR's KV-cached calls
give the same logits), so the strategies can be checked against the golden cases without the
engine; the engine's golden test must give the same tokens and NFE.

Contract mirrored here: canvas T = ceil((P + max_tokens) / B) * B, blocks (max(P, kB), (k+1)B)
aligned to position 0 from k = P // B; the view is the block's slots; [MASK] logits are -inf (as
engine/decide.py does); `Decision.commit` / `replace` applied; `Decision.stop` ends the request at
once; after `block_done`, a block whose tokens hold a stop id (stop_token_ids, plus EOS unless
ignore_eos and if `strategy.eos_ends_request`) ends it; the output is the first max_tokens slots
cut after the first stop id or EOS (unless ignore_eos), inclusive; NFE = decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from cover_vllm import SamplingParams
from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies import (BlockState, StepBatch, Strategy, decide_now, make_params,
                                   strategy_class)

# forward(input_ids [L], mask [L, L] bool, True = may attend) -> logits [L, V]
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RefRequest:
    prompt: list[int]
    params: SamplingParams
    strategy: Strategy
    canvas: torch.Tensor = field(init=False)        # [T]
    blocks: list[tuple[int, int]] = field(init=False)
    block_idx: int = 0
    state: BlockState | None = None
    nfe: int = 0
    finish_reason: str | None = None
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))

    def __post_init__(self) -> None:
        p, spec = self.params, self.strategy.spec
        size = p.block_length or self.strategy.default_block_length(p.max_tokens)
        num_p = len(self.prompt)
        total = -(-(num_p + p.max_tokens) // size) * size
        self.canvas = torch.full((total,), spec.mask_token_id, dtype=torch.long)
        self.canvas[:num_p] = torch.tensor(self.prompt)
        self.blocks = [(max(num_p, k * size), (k + 1) * size)
                       for k in range(num_p // size, total // size)]
        self.size = size
        self.begin_block(None)

    @property
    def block(self) -> tuple[int, int]:
        return self.blocks[self.block_idx]

    def masked(self) -> int:
        start, end = self.block
        return int((self.canvas[start:end] == self.strategy.spec.mask_token_id).sum())

    def begin_block(self, memory: dict | None) -> None:
        self.state = BlockState(block_steps=0, memory=memory or {}, block_size=self.size,
                                max_tokens=self.params.max_tokens, steps=self.params.steps)
        self.strategy.start_block(self.state, self.masked())

    def stop_ids(self, eos: bool) -> set[int]:
        ids = set(self.params.stop_token_ids)
        if eos and not self.params.ignore_eos:
            ids |= set(self.strategy.spec.eos_token_ids)
        return ids

    def output(self) -> list[int]:
        gen = self.canvas[len(self.prompt): len(self.prompt) + self.params.max_tokens].tolist()
        ids = self.stop_ids(eos=True)
        cut = next((i for i, t in enumerate(gen) if t in ids), None)
        return gen if cut is None else gen[: cut + 1]


def block_mask(length: int, size: int) -> torch.Tensor:
    """[L, L] bool: query block i sees key blocks <= i (blocks aligned to position 0)."""
    blk = torch.arange(length) // size
    return blk[:, None] >= blk[None, :]


def _step_batch(reqs: list[RefRequest], logits: list[torch.Tensor]) -> StepBatch:
    n, width = len(reqs), max(r.block[1] - r.block[0] for r in reqs)
    spec = reqs[0].strategy.spec
    padded = torch.zeros(n, width, logits[0].shape[-1])
    tokens = torch.full((n, width), spec.mask_token_id)
    valid = torch.zeros(n, width, dtype=torch.bool)
    for i, (r, lg) in enumerate(zip(reqs, logits)):
        start, end = r.block
        padded[i, : end - start], tokens[i, : end - start] = lg, r.canvas[start:end]
        valid[i, : end - start] = True
    padded[..., spec.mask_token_id] = float("-inf")
    params = [r.params for r in reqs]
    return StepBatch(
        logits=padded, tokens=tokens, valid=valid, in_block=valid.clone(), is_gen=valid.clone(),
        states=[r.state for r in reqs],
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
        generators=[r.generator for r in reqs], mask_id=spec.mask_token_id)


def _finish_block(r: RefRequest) -> None:
    start, end = r.block
    held = set(r.canvas[len(r.prompt): end].tolist())
    if held & r.stop_ids(eos=r.strategy.eos_ends_request):
        r.finish_reason = "stop"
    elif r.block_idx + 1 == len(r.blocks):
        r.finish_reason = "stop" if set(r.output()) & r.stop_ids(eos=True) else "length"
    else:
        r.block_idx += 1
        r.begin_block(r.state.memory)


def run_requests(forward: Forward, spec: ModelSpec, prompts: list[list[int]],
                 params: list[SamplingParams]) -> list[RefRequest]:
    """Every request to its end in lockstep, one batched `decide` per strategy each step."""
    strategies: dict[tuple, Strategy] = {}
    reqs = []
    for prompt, p in zip(prompts, params):
        key = (p.decoding, repr(p.decoding_params))
        if key not in strategies:
            strategies[key] = strategy_class(p.decoding)(make_params(p.decoding,
                                                                     p.decoding_params), spec)
        strategies[key].check_steps(p.steps, p.max_tokens)
        reqs.append(RefRequest(prompt, p, strategies[key]))
    while active := [r for r in reqs if r.finish_reason is None]:
        logits = []
        for r in active:
            start, end = r.block
            out = forward(r.canvas[:end], block_mask(end, r.size))
            logits.append(out[start:end])
            r.nfe += 1
        for strategy in {id(r.strategy): r.strategy for r in active}.values():
            group = [i for i, r in enumerate(active) if r.strategy is strategy]
            _decide(strategy, [active[i] for i in group], [logits[i] for i in group])
    return reqs


def _decide(strategy: Strategy, reqs: list[RefRequest], logits: list[torch.Tensor]) -> None:
    d = decide_now(strategy, _step_batch(reqs, logits))
    for i, r in enumerate(reqs):
        start, end = r.block
        w = end - start
        change = d.commit[i, :w] | (d.replace[i, :w] if d.replace is not None else False)
        r.canvas[start:end] = torch.where(change, d.tokens[i, :w], r.canvas[start:end])
        r.state.step += 1
        if d.stop is not None and bool(d.stop[i]):
            r.finish_reason = "stop"
        elif strategy.block_done(r.state, r.masked()):
            _finish_block(r)
