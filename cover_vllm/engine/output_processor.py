"""Stop checks on FINAL tokens and RequestOutput assembly (detokenisation lives here only, with
the per-token logprob dicts of engine/logprobs.py)."""

from __future__ import annotations

from cover_vllm.engine.logprobs import LogprobBuilder
from cover_vllm.outputs import CompletionOutput, RequestOutput
from cover_vllm.scheduler.request import Request


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.eos = tokenizer, set(eos_token_ids)
        self.logprobs = LogprobBuilder(tokenizer)

    def decode(self, ids: list[int], params=None) -> str:
        """The text of `ids` under a request's SamplingParams (skip_special_tokens; "" with
        detokenize=False or without a tokenizer)."""
        if self.tokenizer is None or (params is not None and not params.detokenize):
            return ""
        skip = True if params is None else params.skip_special_tokens
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def check_stop(self, req: Request) -> tuple[str | None, list[int], str, int | str | None]:
        """After a block is FINAL: ('stop' if an EOS/stop token or stop string appeared, else
        None; the final token ids and text up to the stop point; vLLM's stop_reason: the stop
        string or stop token id that matched, None for EOS). A Request's stop rule.
        With include_stop_str_in_output the text keeps the stop string or the stop token's
        text (never EOS's)."""
        p = req.params
        final = req.canvas[req.prompt_len:min(req.final_end, req.gen_end)].tolist()
        eos = set() if p.ignore_eos else self.eos
        stop_ids = set(p.stop_token_ids) | eos
        cut = next((i for i, t in enumerate(final) if t in stop_ids), None)
        ids = final if cut is None else final[: cut + 1]
        keep_stop = cut is not None and p.include_stop_str_in_output and final[cut] not in eos
        text = self.decode(ids if cut is None or keep_stop else ids[:-1], p)
        reason = None if cut is None else "stop"
        # vLLM checks EOS before stop_token_ids: an EOS that is also listed reports None
        stop_reason = None if cut is None or final[cut] in eos else final[cut]
        if reason and not req.strategy.eos_ends_request and final[cut] not in \
                req.params.stop_token_ids and req.final_end < req.gen_end:
            reason = None       # the decoder generates every block (LLaDA2.1): cut, not ended
        for stop in p.stop:
            at = text.find(stop)
            if at >= 0:
                end = at + len(stop) if p.include_stop_str_in_output else at
                text, reason, stop_reason = text[:end], "stop", stop
                ids = self._ids_for_text(ids, end, p)
        return reason, ids, text, stop_reason if reason else None

    def _ids_for_text(self, ids: list[int], length: int, params) -> list[int]:
        """Shortest prefix of ids whose text reaches `length` characters (covers the stop)."""
        for n in range(len(ids) + 1):
            if len(self.decode(ids[:n], params)) >= length:
                return ids[:n]
        return ids

    def stable_text(self, req: Request) -> str:
        """The part of a running request's text that no later block can change: a possible
        stop-string start and an incomplete trailing character are held back."""
        text = req.output_text
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        text = text[: len(text) - hold] if hold else text
        return text.rstrip("\ufffd")

    def make_output(self, req: Request, index: int = 0) -> RequestOutput:
        """The request's output so far (a partial one carries its stable text only); `index`
        is its place among its parent's n outputs (engine/parallel_sampling.py)."""
        m = req.stamp_metrics()
        done = req.finish_reason is not None
        text = req.output_text if done else self.stable_text(req)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[self._completion(req, index, text, done)], finished=done, metrics=m)

    def _completion(self, req: Request, index: int, text: str, done: bool) -> CompletionOutput:
        ids = list(req.output_token_ids)
        out = CompletionOutput(index, text, ids, req.finish_reason,
                               req.stop_reason if done else None)
        if req.params.logprobs is not None:
            out.logprobs = self.logprobs.extend(req.output_logprobs, req.token_logprobs,
                                                req.prompt_len, ids)
            out.cumulative_logprob = sum(d[t].logprob for t, d in zip(ids, out.logprobs))
        return out
