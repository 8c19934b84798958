"""`decoding="diffusion_gemma"`: DiffusionGemma's uniform-state sampler, as transformers 5.24's
`DiffusionGemmaGenerationMixin.generate` runs it (../shared/golden/README.md "### `generate`").

Per canvas of C tokens: an initial canvas uniform over the whole vocabulary, then denoising steps
cur_step = N, N-1, ..., 1 (N = `max_denoising_steps`), each one decoder forward:

    T = t_min + (t_max - t_min) * (cur_step / N)       linear schedule, float32 tensor arithmetic
    processed = logits / T                              (LinearTemperatureScheduleLogitsProcessor)
    sample ~ softmax(processed) per position            one multinomial draw per position
    H = entropy of softmax(processed) per position
    accept the lowest-entropy positions while the entropies ranked before them sum to <= bound
                                                        (EntropyBoundSampler: Ben-Hamu et al.,
                                                         "Accelerated Sampling from Masked
                                                         Diffusion Models via Entropy Bounded
                                                         Unmasking", rank 0 always accepted)
    next canvas = sample where accepted, else a uniform re-draw (renoise; nothing is frozen)
    stop when stable (argmax == the last `stability_threshold` steps' argmaxes) and confident
    (mean H < `confidence_threshold`)                   (StableAndConfidentStoppingCriteria)

The output of a canvas is its last step's argmax. Draws, in this order, from the request's own
generator: the initial canvas `randint(0, V, (C,))`; per step the multinomial (on the CPU
`argmax(p / q)` with q one `exponential_` draw of [C, V], the ops `torch.multinomial` runs, written
out so no value is read back) then the renoise `randint(0, V, (C,))`. Defaults: the checkpoint's
generation_config.json, else transformers' (48 steps, bound 0.1, t 0.4 -> 0.8, stability 1,
confidence 0.005).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies.base import StrategyParams
from cover_vllm.strategies.canvas import CanvasBatch, CanvasDecision, CanvasDecoder, CanvasState
from cover_vllm.strategies.sampling import on_device

# transformers' generate defaults (the golden README's generation_config.json)
DEFAULTS = {"max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
            "stability_threshold": 1, "confidence_threshold": 0.005}
CHUNK_BYTES = 1 << 28       # a decision reads at most this much of fp32 logits at once (256 MiB)
# SamplingParams fields the sampler has its own knob for, and what to use instead
NOT_APPLICABLE = {
    "temperature": "its temperature follows the schedule decoding_params.t_max -> t_min",
    "top_p": "it samples from the whole tempered distribution",
    "top_k": "it samples from the whole tempered distribution",
    "steps": "its steps per canvas are decoding_params.max_denoising_steps",
    "block_length": "its canvas is the model's canvas_length",
    "kv_cache": "the encoder's K/V are exact and always reused",
    "cache_refresh": "the encoder's K/V never go stale",
    **dict.fromkeys(("min_tokens", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"),
                    "its sampler reads the model's own logits (the logits processors serve the "
                    "masked decoders)"),
}


@dataclass(frozen=True)
class DiffusionGemmaParams(StrategyParams):
    """The sampler's knobs (transformers' generate kwargs; `entropy_bound` is its
    `sampler_config`'s). None: the checkpoint's generation_config.json, else DEFAULTS."""

    max_denoising_steps: int | None = None
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        checks = {"max_denoising_steps": (1, "an integer >= 1"),
                  "stability_threshold": (0, "an integer >= 0"),
                  "entropy_bound": (0.0, "a number >= 0"), "t_min": (0.0, "a number >= 0"),
                  "t_max": (0.0, "a number > 0"), "confidence_threshold": (0.0, "a number >= 0")}
        for name, (low, what) in checks.items():
            value = getattr(self, name)
            if value is None:
                continue
            if value < low or (name == "t_max" and value <= 0):
                raise ValueError(f"decoding_params.{name} must be {what} "
                                 f"(decoding='diffusion_gemma'), got {value!r}")

    def resolved(self, generation_config: dict) -> "DiffusionGemmaParams":
        """Every knob set: given, else generation_config.json's, else transformers' default."""
        sampler = generation_config.get("sampler_config") or {}
        given = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                source = sampler if f.name == "entropy_bound" else generation_config
                value = source.get(f.name, DEFAULTS[f.name])
            given[f.name] = value
        return DiffusionGemmaParams(**given)


def step_temperature(p: DiffusionGemmaParams, steps_left: int) -> float:
    """T of the step with cur_step = `steps_left`, as the reference computes it: float32 tensor
    arithmetic on an int32 cur_step (returned as the float32 value)."""
    cur = torch.tensor(steps_left, dtype=torch.int32)
    return float(p.t_min + (p.t_max - p.t_min) * (cur / p.max_denoising_steps))


def entropies(processed: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] entropy of softmax(processed), as `Categorical(logits=).entropy()`."""
    logp = processed - processed.logsumexp(-1, keepdim=True)
    p_log_p = logp.clamp(min=torch.finfo(logp.dtype).min) * logp.softmax(-1)
    return -p_log_p.sum(-1)


def entropy_bound_accept(h: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[n, C] entropies, [n] bounds -> [n, C] bool: sorted ascending, a position is accepted
    while the entropies ranked before it sum to <= its row's bound (a prefix of the order)."""
    sorted_h, order = torch.sort(h, dim=-1)
    before = torch.cumsum(sorted_h, dim=-1) - sorted_h
    return torch.zeros_like(h, dtype=torch.bool).scatter(-1, order, before <= bound[:, None])


class DiffusionGemmaDecoder(CanvasDecoder):
    name = "diffusion_gemma"
    params_cls = DiffusionGemmaParams

    def __init__(self, params: DiffusionGemmaParams, spec: ModelSpec):
        super().__init__(params, spec)
        self.knobs = params.resolved(spec.generation_config)
        self.vocab = spec.vocab_size

    def check_request(self, params) -> None:
        default = type(params)()
        bad = [name for name in NOT_APPLICABLE if getattr(params, name) != getattr(default, name)]
        if bad:
            raise ValueError(
                f"SamplingParams {bad} are not used by decoding='diffusion_gemma': "
                + "; ".join(f"{name}: {NOT_APPLICABLE[name]}" for name in bad)
                + " (leave them unset)")

    # ---- host: the schedule ------------------------------------------------------------------
    def start_canvas(self) -> CanvasState:
        steps = self.knobs.max_denoising_steps
        return CanvasState(steps_left=steps, temperature=step_temperature(self.knobs, steps))

    def initial_canvas(self, generator, length: int, device: torch.device) -> torch.Tensor:
        return torch.randint(0, self.vocab, (length,), generator=generator, device=device)

    def absorb(self, batch: CanvasBatch, decision: CanvasDecision) -> None:
        k = self.knobs
        for i, state in enumerate(batch.states):
            argmax = decision.argmax[i]
            need = k.stability_threshold
            stable = need == 0 or (len(state.history) >= need and all(
                torch.equal(argmax, old) for old in state.history[-need:]))
            state.history = (state.history + [argmax])[-max(need, 1):]
            state.step += 1
            state.steps_left -= 1
            state.done = state.steps_left == 0 or (stable and bool(decision.confident[i]))
            if state.rewind is not None and not state.done:   # undo the next canvas's draw
                batch.generators[i].set_state(state.rewind)
            state.rewind = None
            if not state.done:
                state.temperature = step_temperature(k, state.steps_left)

    # ---- device: the decision ----------------------------------------------------------------
    def decide(self, batch: CanvasBatch) -> CanvasDecision:
        logits = batch.logits
        n, c, v = logits.shape
        k = self.knobs
        bound = on_device([k.entropy_bound] * n, logits, torch.float32)
        parts = []
        rows = max(1, CHUNK_BYTES // (c * v * logits.element_size()))
        for lo in range(0, n, rows):
            parts.append(self._chunk(batch, lo, min(n, lo + rows), bound))
        canvas, argmax, accepted, mean_h, nxt = (torch.cat(t) for t in zip(*parts))
        confident = mean_h < on_device([k.confidence_threshold] * n, logits, torch.float32)
        return CanvasDecision(canvas, argmax, accepted, confident,
                              nxt if any(batch.draw_next) else None)

    def _chunk(self, batch: CanvasBatch, lo: int, hi: int, bound: torch.Tensor):
        """Requests lo..hi-1: (next canvas, argmax, accepted, mean entropy, next initial canvas);
        the draws per request from its own generator, in the reference's order."""
        x = batch.logits[lo:hi]                                        # [m, C, V]
        m, c, v = x.shape
        argmax = x.argmax(-1)
        h = entropies(x)                                               # [m, C]
        probs = x.softmax(-1)
        q = torch.empty_like(probs)
        renoise = torch.empty(m, c, dtype=torch.long, device=x.device)
        nxt = torch.zeros_like(renoise)
        for j in range(m):
            gen = batch.generators[lo + j]
            q[j].exponential_(generator=gen)                   # the step's multinomial draw
            renoise[j] = torch.randint(0, v, (c,), generator=gen, device=x.device)
            if batch.draw_next[lo + j]:          # speculative: rewound unless the canvas stops
                batch.states[lo + j].rewind = None if gen is None else gen.get_state()
                nxt[j] = self.initial_canvas(gen, c, x.device)
        sample = (probs / q).argmax(-1)
        accepted = entropy_bound_accept(h, bound[lo:hi])
        return torch.where(accepted, sample, renoise), argmax, accepted, h.mean(-1), nxt
