"""CanvasRequest: one uniform-state generation (DiffusionGemma): its prompt and finished
canvases, the canvas being denoised, what is still to encode, its pages and ring, counters.

Life of a request with K = ceil(max_tokens / C) canvases of C tokens:

    admitted: first canvas drawn (engine/canvas_decide.py) -> step 1: encode the prompt, denoise
    canvas 0 -> ... -> its decoder stops it: the last argmax is FINAL (appended to `canvas`),
    stop-checked (EOS, stop ids / strings) -> step: encode that canvas, denoise canvas 1 (drawn
    at the end of the canvas's last step) -> ... -> "stop" or "length" after canvas K - 1.

Only the scheduler (pages, ring, status) and the request itself write this state; its
decoder's per-canvas state (`CanvasState`) is the decoder's, set by `start_canvas` and advanced
by `absorb`. To the output processor it looks like a masked Request: `canvas` holds the prompt
and the FINAL tokens, `final_end` / `gen_end` bound them, `strategy` answers `eos_ends_request`.
"""

from __future__ import annotations

import time

import torch

from cover_vllm.outputs import RequestMetrics
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.scheduler.output import CanvasItem
from cover_vllm.scheduler.request import KeptLogprobs, RequestStatus, StopRule
from cover_vllm.step_plan import TokenLogprobs
from cover_vllm.strategies.canvas import CanvasDecision, CanvasDecoder


class CanvasRequest:
    grammar = None                        # structured outputs are refused for these

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, decoder: CanvasDecoder,
                 generator: torch.Generator | None, canvas_length: int):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids = list(prompt_token_ids)
        self.strategy, self.generator = decoder, generator
        self.prompt_len = len(prompt_token_ids)
        self.canvas_length = canvas_length
        self.num_canvases = -(-params.max_tokens // canvas_length)
        self.canvas = torch.tensor(self.prompt_token_ids, dtype=torch.long)  # + FINAL canvases
        self.final_end = self.prompt_len
        self.canvas_idx = 0
        self.state = decoder.start_canvas()
        self.tokens: torch.Tensor | None = None     # [C] the canvas fed to the next step
        self.to_encode: torch.Tensor | None = self.canvas.clone()   # written next step
        self.encoded = 0                            # positions whose K/V are written
        self.key_slots: torch.Tensor | None = None  # [kv_positions] full-layer slots
        self.pages: list[int] = []
        self.ring: int | None = None
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics()
        self.arrival = time.perf_counter()
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: int | str | None = None
        self.token_logprobs: dict[int, KeptLogprobs] = {}    # FINAL positions' (last step's)
        self.output_logprobs: list = []
        self._step_logprobs: TokenLogprobs | None = None     # the latest step's

    # ---- geometry ----------------------------------------------------------------------------
    @property
    def gen_end(self) -> int:
        return self.prompt_len + self.params.max_tokens

    @property
    def kv_positions(self) -> int:
        """Positions whose K/V are ever written: the prompt and every canvas but the last."""
        return self.prompt_len + (self.num_canvases - 1) * self.canvas_length

    @property
    def total_len(self) -> int:
        """Positions the request spans: the prompt and every canvas (max_model_len's bound)."""
        return self.prompt_len + self.num_canvases * self.canvas_length

    @property
    def has_next_canvas(self) -> bool:
        return self.canvas_idx + 1 < self.num_canvases

    # ---- one step ----------------------------------------------------------------------------
    def next_item(self) -> CanvasItem:
        """This step's work: what is left to encode, then the current canvas; the encoded
        tokens count as written from here on (the runner writes them in this step)."""
        ids, start = self.to_encode, self.encoded
        if ids is not None:
            self.encoded += int(ids.numel())
            self.to_encode = None
        return CanvasItem(self.request_id, ids, start, self.tokens, self.encoded,
                          self.state.temperature, self.state.step > 0, self.key_slots,
                          self.ring, want_logits=self.params.logprobs is not None)

    def charge(self, encoder_flops: float, decoder_flops: float, tokens: int) -> None:
        m = self.metrics
        m.encoder_flops += encoder_flops
        m.flops += encoder_flops + decoder_flops
        m.forward_tokens += tokens

    def finish_step(self, decision: CanvasDecision, logprobs: TokenLogprobs | None,
                    stop_rule: StopRule) -> str | None:
        """After the step's decision (host, this request's row; its decoder has absorbed it):
        the next canvas to feed, or, when the canvas stopped, its argmax made FINAL and checked.
        Returns None, "block" (a canvas became FINAL; the request goes on) or the finish
        reason."""
        m = self.metrics
        m.nfe += 1
        m.steps += 1
        m.accepted_tokens += int(decision.accepted.sum())
        if logprobs is not None:
            self._step_logprobs = logprobs
        if not self.state.done:
            self.tokens = decision.canvas
            return None
        m.canvases += 1
        start = self.canvas.numel()
        self.canvas = torch.cat([self.canvas, decision.argmax])
        self.final_end = self.canvas.numel()
        if self._step_logprobs is not None:
            self._keep_logprobs(start, self._step_logprobs)
        reason, self.output_token_ids, self.output_text, self.stop_reason = stop_rule(self)
        if reason is None and not self.has_next_canvas:
            reason = "length"
        if reason is not None:
            return reason
        self.canvas_idx += 1
        self.to_encode = decision.argmax.clone()
        self.tokens = decision.next_canvas
        self.state = self.strategy.start_canvas()
        return "block"

    def _keep_logprobs(self, start: int, logprobs: TokenLogprobs) -> None:
        for i, ids, values, rank in zip(logprobs.positions.tolist(), logprobs.token_ids.tolist(),
                                        logprobs.logprobs.tolist(), logprobs.ranks.tolist()):
            self.token_logprobs[start + i] = (ids, values, rank)

    def stamp_metrics(self) -> RequestMetrics:
        m = self.metrics
        m.latency_s = time.perf_counter() - self.arrival
        m.decoded_tokens = min(self.final_end, self.gen_end) - self.prompt_len
        m.tokens_per_step = m.decoded_tokens / m.steps if m.steps else 0.0
        return m
