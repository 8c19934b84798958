"""Nemotron-Labs-Diffusion's three decodings of one checkpoint, as per-request state machines:
`nemotron` (the official `generate`: block diffusion with a causal commit), `ar` (its
`ar_generate`) and `linear_spec` (its `linear_spec_generate`: self-speculation, here batched).

Each request says what its next forward is (`next_piece`: tokens, attention mode, whether the
K/V are written, which logits rows it needs; models/nemotron_cache.py) and takes back what was
decided on those rows (`absorb`): per row the picked token and, when it `wants_confidence`, that
token's softmax probability, computed for the whole batch on the logits' device and copied to the
host once a step (strategies/nemotron_decide.py); a request's own work is on plain lists. The
runner (engine/nemotron_runner.py) forwards every running request's piece in one batch, so the
three decodings mix freely; a request never depends on the others.

NFE follows the official counts (../shared/golden/README.md "Nemotron-Labs-Diffusion"):
`generate` counts every diffusion forward and each block's commit, not the prefill; `ar_generate`
counts generated tokens; `linear_spec_generate` counts the prefill, every draft and every verify.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from cover_vllm.models.nemotron_cache import Piece
from cover_vllm.strategies.base import StrategyParams


def float32(value: float) -> float:
    """`value` rounded to float32: the official code compares float32 confidences with a Python
    threshold, which torch rounds to the tensor's dtype first."""
    return struct.unpack("f", struct.pack("f", value))[0]


def top_k(scores: list[float], k: int) -> list[int]:
    """The positions of the k highest `scores` (float32 values; -inf for positions that may not
    be chosen), as `torch.topk(scores, k).indices` chooses them on the host (the official order
    of selection). Without a tie across the k-th place the set is the same whatever the tie
    rule, so Python's sort decides; a tie there (rare: two equal float32 probabilities) asks
    torch.topk itself, so even then the tokens stay the official ones."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if 0 < k < len(scores) and scores[order[k - 1]] == scores[order[k]]:
        return _torch_topk(scores, k)
    return order[:k]


def _torch_topk(scores: list[float], k: int) -> list[int]:
    """torch.topk's indices, in its order, over float32 `scores` on the host."""
    return torch.topk(torch.tensor(scores, dtype=torch.float32), k).indices.tolist()


def _check_threshold(value: float | None, low_ok: bool) -> None:
    """ValueError unless `value` is None or a probability ((0, 1] unless `low_ok`)."""
    if value is None:
        return
    if not 0.0 <= value <= 1.0 or (value == 0.0 and not low_ok):
        raise ValueError(f"decoding_params.threshold={value!r}; give a probability in "
                         f"{'[0, 1]' if low_ok else '(0, 1]'}")


@dataclass(frozen=True)
class NemotronParams(StrategyParams):
    """The official `generate`'s knobs (block_length is SamplingParams.block_length)."""

    threshold: float | None = None       # None: the fixed top-k schedule only
    causal_context: bool = True          # causal prefill / commits and the seed token
    max_thinking_tokens: int | None = None
    end_think_token_id: int | None = None

    def __post_init__(self) -> None:
        _check_threshold(self.threshold, low_ok=False)
        if (self.max_thinking_tokens is None) != (self.end_think_token_id is None):
            raise ValueError("decoding_params.max_thinking_tokens and end_think_token_id go "
                             "together: give both or neither")
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 0:
            raise ValueError("decoding_params.max_thinking_tokens must be >= 0")


@dataclass(frozen=True)
class ARParams(StrategyParams):
    """`ar_generate`'s knobs."""

    max_thinking_tokens: int | None = None
    end_think_token_id: int | None = None


@dataclass(frozen=True)
class LinearSpecParams(StrategyParams):
    """`linear_spec_generate`'s knobs: threshold 0 drafts a block in one forward; above 0 the
    draft takes rounds that commit every mask at or above it (at least the best one)."""

    threshold: float = 0.0
    max_thinking_tokens: int | None = None
    end_think_token_id: int | None = None

    def __post_init__(self) -> None:
        _check_threshold(self.threshold, low_ok=True)


class CausalDecoding:
    """A decoding this family runs outside the masked-strategy engine (the registry's
    `CAUSAL_DECODERS`); constructed like a strategy, it only carries its params."""

    params_cls: type = StrategyParams
    name = ""

    def __init__(self, params: StrategyParams, spec=None):
        self.params, self.spec = params, spec


class Nemotron(CausalDecoding):
    params_cls, name = NemotronParams, "nemotron"


class AR(CausalDecoding):
    params_cls, name = ARParams, "ar"


class LinearSpec(CausalDecoding):
    params_cls, name = LinearSpecParams, "linear_spec"


@dataclass
class Job:
    """One request's fixed inputs."""

    prompt: list[int]
    max_tokens: int
    block_length: int
    mask_id: int
    eos_ids: tuple[int, ...]
    temperature: float = 0.0
    seed: int = 0                     # temperature > 0: the request's generator's seed


class Loop:
    """Base of the three state machines: `generated`, `nfe`, `finished`, `stopped` (an EOS)."""

    def __init__(self, job: Job, params):
        self.job, self.params = job, params
        self.generated: list[int] = []
        self.nfe = 0
        self.finished = self.stopped = False
        self.slot = -1
        self.cached = 0                         # prompt positions restored from the prefix cache
        self.indexed = False                    # its prompt's K/V are in the prefix cache
        self.accepted: list[int] = []           # linear_spec: tokens accepted per verify
        self.arrival = 0.0                      # perf_counter() when queued
        self.generator: torch.Generator | None = None   # temperature > 0 (nemotron_decide.py)

    def capacity(self) -> int:
        """Cache positions this request may write (prompt, canvas and a spare block)."""
        return len(self.job.prompt) + self.job.max_tokens + 2 * self.job.block_length + 1

    @property
    def wants_confidence(self) -> bool:
        """Whether the next `absorb` reads the picks' softmax probabilities."""
        return False

    def output(self) -> list[int]:
        """The generated tokens through the first EOS, at most max_tokens."""
        out = self.generated[:self.job.max_tokens]
        for i, tok in enumerate(out):
            if tok in self.job.eos_ids:
                self.stopped = True
                return out[:i + 1]
        return out

    def prefill_piece(self, causal: bool, want_logit: bool) -> Piece:
        """The prompt's rows not restored from the prefix cache, written."""
        rest = self.job.prompt[self.cached:]
        return Piece(self.slot, rest, causal, True, [len(rest) - 1] if want_logit else [])

    @property
    def causal_prefill(self) -> bool:
        """Whether the prefill is causal (so its K/V may come from the prefix cache)."""
        return True

    def _think_due(self, seen: list[int]) -> bool:
        p = self.params
        return p.end_think_token_id is not None and p.end_think_token_id not in seen


class BlockLoop(Loop):
    """`generate`: causal (or, without causal_context, diffusion-mode) prefill; per block at
    most block_length diffusion forwards unmasking the top-k by confidence (the masked count
    split evenly over the steps, remainder first; with a threshold every masked position is a
    candidate and, after the first, those below it are dropped), early exit once an EOS has no
    mask before it; then one forward of the finished block writing its K/V, whose last logit
    seeds the next block."""

    def __init__(self, job: Job, params: NemotronParams):
        super().__init__(job, params)
        self.num_blocks = -(-job.max_tokens // job.block_length)
        self.block_index = -1
        self.block: list[int] = []
        self.seed: int | None = None
        self.phase = "prefill"
        self.threshold = None if params.threshold is None else float32(params.threshold)

    def next_piece(self) -> Piece:
        cc, b = self.params.causal_context, self.job.block_length
        if self.phase == "prefill":
            return self.prefill_piece(cc, cc)
        tokens = list(self.block)
        if self.phase == "commit":
            return Piece(self.slot, tokens, cc, True, [b - 1] if cc else [])
        return Piece(self.slot, tokens, False, False, list(range(b)))

    @property
    def wants_confidence(self) -> bool:
        return self.phase == "denoise"

    def absorb(self, tokens: list[int], confidence: list[float] | None, cache=None) -> None:
        if self.phase == "prefill":
            self.seed = tokens[-1] if tokens else None
            self._start_block()
        elif self.phase == "denoise":
            self.nfe += 1
            self._unmask(tokens, confidence)
            self.step += 1
            if self.step >= self.job.block_length or self._eos_done() \
                    or self.job.mask_id not in self.block:
                self.phase = "commit"
        else:
            self.nfe += 1
            self.seed = tokens[-1] if tokens else None
            self.generated += self.block
            if any(t in self.job.eos_ids for t in self.generated) \
                    or self.block_index + 1 >= self.num_blocks:
                self.finished = True
            else:
                self._start_block()

    @property
    def causal_prefill(self) -> bool:
        return self.params.causal_context

    def _start_block(self) -> None:
        b, p = self.job.block_length, self.params
        self.block_index += 1
        self.block = [self.job.mask_id] * b
        if p.causal_context and self.seed is not None:
            self.block[0] = self.seed
        before = self.block_index * b
        if p.max_thinking_tokens is not None and before + b > p.max_thinking_tokens \
                and self._think_due(self.generated):
            self.block[max(0, p.max_thinking_tokens - before)] = p.end_think_token_id
        masked = self.block.count(self.job.mask_id)
        base, extra = divmod(masked, b)
        self.schedule = [base + (i < extra) for i in range(b)]      # remainder first
        self.step = 0
        self.phase = "denoise" if masked else "commit"

    def _unmask(self, tokens: list[int], confidence: list[float]) -> None:
        """The official step: the top-k masked positions by confidence (with a threshold, every
        masked one ranked: the best, then the others at or above it) take their picks."""
        mask_id, threshold = self.job.mask_id, self.threshold
        scores = [c if t == mask_id else -math.inf for t, c in zip(self.block, confidence)]
        k = self.block.count(mask_id) if threshold is not None else self.schedule[self.step]
        if threshold is None or k == 1:
            chosen = top_k(scores, k)
        else:               # only the best is taken below the threshold: a tie there matters
            best = max(scores)
            tied = best < threshold and scores.count(best) > 1
            first = _torch_topk(scores, k)[0] if tied else scores.index(best)
            chosen = [first] + [i for i, c in enumerate(scores) if c >= threshold and i != first]
        for i in chosen:
            self.block[i] = tokens[i]

    def _eos_done(self) -> bool:
        """An EOS in the block with no [MASK] before it (the official early exit)."""
        for i, tok in enumerate(self.block):
            if tok in self.job.eos_ids:
                return self.job.mask_id not in self.block[:i]
        return False


class ARLoop(Loop):
    """`ar_generate`: causal prefill, then one token a step; NFE = tokens generated."""

    def next_piece(self) -> Piece:
        if not self.generated:
            return self.prefill_piece(True, True)
        return Piece(self.slot, self.generated[-1:], True, True, [0])

    def absorb(self, tokens: list[int], confidence: list[float] | None, cache=None) -> None:
        tok = tokens[-1]
        p = self.params
        if p.max_thinking_tokens is not None and len(self.generated) >= p.max_thinking_tokens \
                and self._think_due(self.generated):
            tok = p.end_think_token_id
        self.generated.append(tok)
        self.nfe += 1
        self.finished = tok in self.job.eos_ids or len(self.generated) >= self.job.max_tokens


class SpecLoop(Loop):
    """`linear_spec_generate`, one request of a batch: after the causal prefill, rounds of a
    diffusion-mode draft of [last token, masks...] (the draft adapter on) and one causal verify
    writing the block's K/V; accepted = the longest prefix where the verify's argmax equals the
    next draft token, plus the bonus; the cache is cut back to what was accepted."""

    def __init__(self, job: Job, params: LinearSpecParams):
        super().__init__(job, params)
        self.phase = "prefill"
        self.block: list[int] = []
        self.next_token = -1
        self.threshold = float32(params.threshold)
        self.cache_len = 0

    def next_piece(self) -> Piece:
        b = self.job.block_length
        if self.phase == "prefill":
            return self.prefill_piece(True, True)
        if self.phase == "draft":
            return Piece(self.slot, list(self.block), False, False, list(range(b)),
                         adapter=True)
        return Piece(self.slot, list(self.block), True, True, list(range(b)))

    @property
    def wants_confidence(self) -> bool:
        return self.phase == "draft" and self.threshold > 0

    def absorb(self, tokens: list[int], confidence: list[float] | None, cache=None) -> None:
        self.nfe += 1
        if self.phase == "prefill":
            self.cache_len = len(self.job.prompt)
            self.next_token = tokens[-1]
            self.generated.append(self.next_token)
            if self.next_token in self.job.eos_ids or len(self.generated) >= self.job.max_tokens:
                self.finished = True
            else:
                self._start_round()
        elif self.phase == "draft":
            self._draft(tokens, confidence)
        else:
            self._verify(tokens, cache)

    def _start_round(self) -> None:
        self.block = [self.job.mask_id] * self.job.block_length
        self.block[0] = self.next_token
        self.phase = "draft" if self.job.mask_id in self.block else "verify"

    def _draft(self, tokens: list[int], confidence: list[float] | None) -> None:
        """Every mask takes its pick (threshold 0), or those at or above the threshold (at
        least the best: the first of equals, as argmax picks it)."""
        mask_id = self.job.mask_id
        masked = [i for i, t in enumerate(self.block) if t == mask_id]
        if self.threshold > 0:
            scores = [c if t == mask_id else -math.inf for t, c in zip(self.block, confidence)]
            masked = [i for i in masked if scores[i] >= self.threshold] \
                or [scores.index(max(scores))]
        for i in masked:
            self.block[i] = tokens[i]
        if mask_id not in self.block:
            self.phase = "verify"

    def _verify(self, ar: list[int], cache) -> None:
        draft = self.block
        accepted = 1
        while accepted < len(draft) and ar[accepted - 1] == draft[accepted]:
            accepted += 1
        self.cache_len += accepted
        cache.truncate(self.slot, self.cache_len)
        kept = ar[:accepted]
        self.accepted.append(accepted)
        for i, tok in enumerate(kept):
            if tok in self.job.eos_ids:
                kept = kept[:i + 1]
                self.generated += kept
                self.finished = True
                return
        self.generated += kept
        self.next_token = ar[accepted - 1]
        p = self.params
        if p.max_thinking_tokens is not None and len(self.generated) > p.max_thinking_tokens \
                and self._think_due(self.generated):
            self.next_token = p.end_think_token_id
        if len(self.generated) >= self.job.max_tokens:
            self.finished = True
        else:
            self._start_round()


LOOPS = {"nemotron": BlockLoop, "ar": ARLoop, "linear_spec": SpecLoop}
