"""A slow reference of DiffusionGemma's `generate` for one prompt: a plain loop over the dense
`model(...)` forward (transformers' call, which re-encodes the prompt and every finished canvas
each time), written from ../shared/golden/README.md "### `generate`" and nothing else. The
engine's paged, batched route is tested against it and it against the golden traces.

Per canvas: the initial canvas `randint(0, V, (1, C))`; per denoising step `cur_step` = N .. 1:
logits -> processed = logits / T (T = t_min + (t_max - t_min) * (cur_step / N), float32 tensor
arithmetic), a multinomial draw over softmax(processed) for every position, the entropy-bound
acceptance, then `randint(0, V, (1, C))` renoise for every position; accepted positions take the
sample, the others the renoise; the processed logits self-condition the next step. The canvas
stops when stable (its argmax equals the last `stability_threshold` steps' argmaxes) and
confident (mean entropy < `confidence_threshold`). The argmax of the last step is appended; a
canvas holding an EOS ends generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributions import Categorical


LOGIT_TOL = 1e-4   # the golden forward logits' bar (the README's observed independent spread: 2e-5)

@dataclass
class RefStep:
    """What one denoising step drew and decided (the golden trace's fields)."""

    decoder_input_ids: list[int]
    sample: list[int]
    accepted: list[int]
    renoise: list[int]
    argmax: list[int]
    mean_entropy: float
    entropy_slope: float     # bound on |d mean_entropy| per unit of raw-logit error


@dataclass
class RefResult:
    new_tokens: list[int]                 # whole canvases, cut after the first EOS
    nfe: int                              # decoder forwards
    steps: list[list[RefStep]] = field(default_factory=list)   # per canvas
    initial: list[list[int]] = field(default_factory=list)     # per canvas
    final_logits: list[torch.Tensor] = field(default_factory=list)   # per canvas: the raw
                                                                   # logits [C, V] of its last step


def temperature(t_min: float, t_max: float, cur_step: int, steps: int) -> torch.Tensor:
    """The step's temperature as the reference computes it (a float32 0-dim tensor)."""
    return t_min + (t_max - t_min) * (torch.tensor(cur_step, dtype=torch.int32) / steps)


def entropy_accept(processed: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, V] processed logits -> (accepted [C] bool, entropies [C]): positions sorted by
    entropy ascending are accepted while the entropies ranked before them sum to <= bound."""
    h = Categorical(logits=processed).entropy()
    sorted_h, order = torch.sort(h, dim=-1)
    before = torch.cumsum(sorted_h, dim=-1) - sorted_h
    accepted = torch.zeros_like(h, dtype=torch.bool)
    accepted[order] = before <= bound
    return accepted, h


def entropy_slope(processed: torch.Tensor, temp: torch.Tensor) -> float:
    """How far the mean entropy of [C, V] `processed` = logits / temp can move per unit of
    error in the raw logits, to first order: dH/dz_j = -p_j (log p_j + H), so an error of at
    most e in every logit moves a position's H by at most e * sum_j p_j |log p_j + H| / temp."""
    logp = torch.log_softmax(processed.float(), dim=-1)
    h = -(logp.exp() * logp).sum(-1, keepdim=True)
    return float((logp.exp() * (logp + h).abs()).sum(-1).mean() / temp)


def reference_generate(model, prompt: list[int], params: dict, seed: int) -> RefResult:
    """Tokens and decoder-forward count of `generate(prompt, **params)` after
    `torch.manual_seed(seed)` (a fresh CPU generator: the README's replay rule)."""
    gen = torch.Generator().manual_seed(seed)
    spec = model.spec
    vocab, c = spec.vocab_size, model.canvas_length
    eos = set(spec.eos_token_ids)
    steps, bound = params["max_denoising_steps"], params["sampler_config"]["entropy_bound"]
    t_min, t_max = params["t_min"], params["t_max"]
    stability, confidence = params["stability_threshold"], params["confidence_threshold"]
    ids = torch.tensor([prompt])
    result = RefResult([], 0)
    for _ in range(-(-params["max_new_tokens"] // c)):
        canvas = torch.randint(0, vocab, (1, c), generator=gen)
        result.initial.append(canvas[0].tolist())
        result.steps.append([])
        sc, history = None, []
        for cur in range(steps, 0, -1):
            with torch.no_grad():
                logits = model(input_ids=ids, decoder_input_ids=canvas,
                               self_conditioning_logits=sc)
            result.nfe += 1
            temp = temperature(t_min, t_max, cur, steps)
            processed = logits / temp
            probs = torch.softmax(processed.float(), dim=-1)
            sample = torch.multinomial(probs.view(c, vocab), 1, generator=gen).view(1, c)
            accepted, h = entropy_accept(processed[0], bound)
            renoise = torch.randint(0, vocab, (1, c), generator=gen)
            argmax = processed.argmax(-1)
            result.steps[-1].append(RefStep(canvas[0].tolist(), sample[0].tolist(),
                                            accepted.int().tolist(), renoise[0].tolist(),
                                            argmax[0].tolist(), float(h.mean()),
                                            entropy_slope(processed[0], temp)))
            canvas = torch.where(accepted[None], sample, renoise)
            stable = stability == 0 or (len(history) >= stability and all(
                torch.equal(argmax, old) for old in history[-stability:]))
            history.append(argmax)
            sc = processed
            if stable and bool(h.mean() < confidence):
                break
        result.final_logits.append(logits[0])
        ids = torch.cat([ids, argmax], dim=1)
        tokens = argmax[0].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in eos), None)
        result.new_tokens += tokens if cut is None else tokens[:cut + 1]
        if cut is not None:
            break
    return result
