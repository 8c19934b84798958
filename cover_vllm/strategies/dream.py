"""Dream-v0 reference decoders: `maskgit_plus`, `topk_margin` and `entropy` unmasking.

Reproduces the HF Dream-v0 `generation_utils.py` (`DreamGenerationMixin._sample` and
`sample_tokens`, as kept in ZHZisZZ/dllm dllm/pipelines/dream/models/generation_utils.py). The
reference has no blocks, so these strategies default to one block of max_tokens slots.

Schedule (Dream's masked-diffusion time grid): t_i = linspace(1, eps, steps + 1)[i] in float32; at
step i with m masked slots, reveal k = floor(m · (1 − t_{i+1} / t_i)) computed in float32, and
every remaining slot at the last step. Candidates: logits / T (T > 0), then top-p, then top-k,
then softmax (float32); argmax at T = 0, else one multinomial draw. Confidence per position:
`maskgit_plus` p(candidate), `topk_margin` p1 − p2, `entropy` Σ p·log(p + 1e-10) (negative
entropy). The k most confident masked slots are revealed, or, with alg_temp > 0, k slots drawn
without replacement from softmax(confidence / alg_temp) (ALGORITHMS.md §2.5).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from cover_vllm.strategies.base import BlockState, Decision, StepBatch, Strategy, StrategyParams
from cover_vllm.strategies.sampling import (filter_top_k_top_p, on_device, sample_candidates,
                                            softmax_probs, topk_mask)


@dataclass(frozen=True)
class DreamParams(StrategyParams):
    eps: float = 1e-3               # last value of the time grid linspace(1, eps, steps + 1)
    alg_temp: float | None = None   # > 0: sample the slots to reveal ~ softmax(conf / alg_temp)

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"decoding_params.eps must be in [0, 1), got {self.eps}")
        if self.alg_temp is not None and self.alg_temp < 0:
            raise ValueError(f"decoding_params.alg_temp must be >= 0 or null, got {self.alg_temp}")


@dataclass
class RevealSchedule:
    """Per-block state of the Dream algorithms: the share of masked slots each step reveals."""

    fractions: list[float]          # [block_steps], from `reveal_fractions`

    def fraction(self, step: int) -> float:
        """The share revealed at `step`; past the grid, everything left."""
        return self.fractions[step] if step < len(self.fractions) else 1.0


def reveal_fractions(steps: int, eps: float) -> torch.Tensor:
    """[steps] float32 share 1 − s/t of the masked slots revealed at each step; 1 at the last."""
    grid = torch.linspace(1, eps, steps + 1)                 # float32, as the reference
    frac = 1 - grid[1:] / grid[:-1]
    frac[-1] = 1.0
    return frac


def transfer_count(batch: StepBatch) -> torch.Tensor:
    """[n] slots to reveal this step (host): floor(masked · fraction) in float32; past the
    grid, all."""
    frac = torch.tensor([st.extra.fraction(st.step) for st in batch.states],
                        dtype=torch.float32)
    return (batch.host.candidates.sum(-1).to(torch.float32) * frac).long()


def dream_candidates(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate tokens [n, W] and the model's probabilities [n, W, V] that scores read.

    Sampling follows `sample_tokens`: temperature, top-p, top-k, then a draw (rows with T > 0 are
    already divided by T, so they are sampled at temperature 1 over each request's own view rows).
    The returned probabilities are softmax(logits), untouched by temperature and truncation, so
    at T = 0 the decisions do not depend on top_p / top_k. The official code scores with the
    tempered, truncated distribution instead; the two agree at T = 0 with top_p = 1 and
    top_k = -1, the settings of every golden case. The softmax includes the [MASK] logit, as the
    official one does (`StepBatch.mask_column`, #48).
    """
    hot = batch.temperature > 0
    scale = torch.where(hot, batch.temperature, 1.0).to(batch.logits.dtype)
    logits = batch.logits / on_device(scale, batch.logits)[:, None, None]
    logits = filter_top_k_top_p(logits, torch.full_like(batch.top_k, -1), batch.top_p)
    logits = filter_top_k_top_p(logits, batch.top_k, torch.ones_like(batch.top_p))
    tokens = sample_candidates(logits, hot.to(batch.temperature.dtype), batch.generators,
                               batch.host.lengths)
    return tokens, softmax_probs(batch.logits, torch.float32, batch.mask_column)


def sample_positions(batch: StepBatch, conf: torch.Tensor, count: torch.Tensor,
                     alg_temp: float) -> torch.Tensor:
    """[n, W] bool: count[i] slots drawn without replacement from softmax(conf[i] / alg_temp).

    conf is −inf off the candidates. Each request draws from its own generator over its own view
    rows only (the draw consumes one number per row), so batching never changes its stream.
    Probabilities that underflow to 0 are raised to the smallest normal float, so drawing k of k
    candidates always succeeds.
    """
    commit = torch.zeros(conf.shape, dtype=torch.bool, device=conf.device)
    lengths = batch.host.lengths
    for i in (count > 0).nonzero().flatten().tolist():
        row = conf[i, : lengths[i]]
        probs = torch.softmax(row / alg_temp, dim=-1)
        tiny = torch.finfo(probs.dtype).tiny
        probs = torch.where(torch.isfinite(row), probs.clamp_min(tiny), 0.0)
        commit[i, torch.multinomial(probs, int(count[i]), generator=batch.generators[i])] = True
    return commit


class DreamDecoder(Strategy):
    """Shared schedule and selection of the three Dream algorithms; subclasses score positions."""

    params_cls = DreamParams
    fixed_schedule = True

    def default_block_length(self, max_tokens: int) -> int:
        return max_tokens                      # `diffusion_generate` has no blocks

    def start_block(self, state: BlockState, num_masked: int) -> None:
        state.extra = RevealSchedule(
            reveal_fractions(state.block_steps, self.params.eps).tolist())

    @abstractmethod
    def confidence(self, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[n, W, V] probabilities, [n, W] candidates -> [n, W] float32 scores (higher: surer)."""

    def decide(self, batch: StepBatch) -> Decision:
        tokens, probs = dream_candidates(batch)
        conf = self.confidence(probs, tokens).masked_fill(~batch.candidates, float("-inf"))
        count = transfer_count(batch)
        alg_temp = self.params.alg_temp
        if alg_temp:
            commit = sample_positions(batch, conf, count, alg_temp)
        else:
            commit = topk_mask(conf, count)
        return Decision(commit=commit, tokens=tokens)


class MaskGitPlus(DreamDecoder):
    name = "maskgit_plus"

    def confidence(self, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return probs.gather(-1, tokens[..., None]).squeeze(-1)


class TopKMargin(DreamDecoder):
    name = "topk_margin"

    def confidence(self, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]


class Entropy(DreamDecoder):
    name = "entropy"

    def confidence(self, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return (probs * torch.log(probs + 1e-10)).sum(-1)
