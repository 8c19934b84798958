"""ParentRequest: SamplingParams.n > 1 as n child requests (vLLM's parallel sampling), each its
own canvas and Request, batched by the scheduler like any others, their outputs merged under
the parent's request id.

Child i is the request f"{i}_{parent id}" (vLLM's naming) with n=1 and, when the parent has a
seed, seed + i (vLLM's `ParentRequest.get_child_info` rule, so child 0 equals the n=1 request);
without a seed each child draws the engine's next seed. A parent output lists, in index order,
the latest CompletionOutput of every child that has reported, and is finished once all n have.

Metrics of a parent: the children's counters summed (the work done for the parent: nfe, steps,
decoded tokens, remasks, FLOPs, ...), latency_s the slowest child's, tokens_per_step
decoded_tokens / steps over the sums.
"""

from __future__ import annotations

import dataclasses

from cover_vllm.outputs import RequestMetrics, RequestOutput
from cover_vllm.sampling_params import SamplingParams, check_n

_NOT_SUMMED = ("latency_s", "tokens_per_step")


def child_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams):
        check_n(params.n, "SamplingParams.")     # again: a dataclass field may have been reset
        self.request_id, self.params = request_id, params
        self.child_ids = [child_id(i, request_id) for i in range(params.n)]
        self.index = {cid: i for i, cid in enumerate(self.child_ids)}
        self._latest: dict[int, RequestOutput] = {}     # index -> its latest output
        self._finished: set[int] = set()

    def child_params(self, index: int) -> SamplingParams:
        seed = None if self.params.seed is None else self.params.seed + index
        return dataclasses.replace(self.params, n=1, seed=seed)

    def add(self, out: RequestOutput) -> None:
        """A child's output (its CompletionOutput carries the child's index)."""
        i = self.index[out.request_id]
        self._latest[i] = out
        if out.finished:
            self._finished.add(i)

    @property
    def finished(self) -> bool:
        return len(self._finished) == len(self.child_ids)

    def output(self) -> RequestOutput:
        """The parent's output as of now: the reported children's outputs in index order."""
        latest = [self._latest[i] for i in sorted(self._latest)]
        return RequestOutput(
            request_id=self.request_id, prompt=latest[0].prompt,
            prompt_token_ids=latest[0].prompt_token_ids,
            outputs=[o.outputs[0] for o in latest], finished=self.finished,
            metrics=merge_metrics([o.metrics for o in latest]))


def merge_metrics(children: list[RequestMetrics]) -> RequestMetrics:
    """Summed counters, the slowest latency, tokens_per_step over the sums."""
    m = RequestMetrics(**{f.name: sum(getattr(c, f.name) for c in children)
                          for f in dataclasses.fields(RequestMetrics)
                          if f.name not in _NOT_SUMMED})
    m.latency_s = max(c.latency_s for c in children)
    m.tokens_per_step = m.decoded_tokens / m.steps if m.steps else 0.0
    return m
