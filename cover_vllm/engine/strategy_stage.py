"""StrategyStage: the engine's one owner of strategies — which instance serves a request, what
each request asks of the next forward (`plan`), and the decisions after it (`decide`).

The scheduler never calls a strategy: it packs the plans into work items. Instances are shared
by every request with the same (name, params), so one vectorised `decide` serves them all; the
cache keeps the `max_strategies` most recently used (a server sees unboundedly many distinct
`decoding_params`). An evicted instance stays alive in the requests that hold it, and a request
built later gets a fresh, equal one: decisions never depend on the batch, so tokens are the same.
"""

from __future__ import annotations

from collections import OrderedDict

from cover_vllm.engine.decide import run_strategies
from cover_vllm.host_transfer import HostTransfer
from cover_vllm.models.spec import ModelSpec
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.scheduler.request import Request
from cover_vllm.step_plan import RowDecision, StepPlan
from cover_vllm.strategies import Strategy, make_params, strategy_class

MAX_STRATEGIES = 64


class StrategyStage:
    def __init__(self, spec: ModelSpec, default_decoding: str,
                 max_strategies: int = MAX_STRATEGIES):
        strategy_class(default_decoding)                   # fail early on a bad default
        self.spec, self.default_decoding = spec, default_decoding
        self.max_strategies = max_strategies
        self._cache: OrderedDict[tuple, Strategy] = OrderedDict()

    def strategy(self, name: str | None, params) -> Strategy:
        """The shared instance for strategy `name` (None: the engine's default) with
        `params` (None, a dict or the typed dataclass; ValueError / TypeError if invalid)."""
        name = name or self.default_decoding
        key = (name, make_params(name, params))
        if key in self._cache:
            self._cache.move_to_end(key)
        else:
            self._cache[key] = strategy_class(name)(key[1], self.spec)
            if len(self._cache) > self.max_strategies:
                self._cache.popitem(last=False)
        return self._cache[key]

    @staticmethod
    def plan(requests: list[Request]) -> list[StepPlan]:
        """What each running request's strategy asks of the next forward (its seeds are
        picked here, from the state its last `decide` left): the seeds and extra rows of
        every request of a strategy instance in one call (`plan_seeds`, `plan_extra_rows`)."""
        seeds = _per_instance(requests, "plan_seeds", "select_seeds")
        extra = _per_instance(requests, "plan_extra_rows", "extra_rows")
        return [_plan(req, s or [], e) for req, s, e in zip(requests, seeds, extra)]

    @staticmethod
    def decide(out: SchedulerOutput, requests: dict[str, Request], result,
               observers=(), transfer: HostTransfer | None = None) -> dict[str, RowDecision]:
        """Every request's decision from the forward's ModelRunnerOutput `result`: one
        vectorised `decide` per strategy instance on the logits' device (each observer's
        `on_decide` sees the batch first), then one copy of them all to the host (`transfer`
        counts it)."""
        return run_strategies(out, requests, result, observers, transfer)


def _per_instance(requests: list[Request], plan: str, single: str) -> list:
    """The hook `plan` (states, canvases, blocks) once per strategy instance whose class
    overrides it or its one-request form `single`, for that instance's requests; each
    request's answer (None for the others)."""
    out: list = [None] * len(requests)
    groups: dict[int, list[int]] = {}
    for i, req in enumerate(requests):
        if req.strategy.overrides(plan, single):
            groups.setdefault(id(req.strategy), []).append(i)
    for members in groups.values():
        reqs = [requests[i] for i in members]
        answers = getattr(reqs[0].strategy, plan)([r.state for r in reqs],
                                                  [r.canvas for r in reqs],
                                                  [r.block for r in reqs])
        for i, answer in zip(members, answers):
            out[i] = answer
    return out


def _plan(req: Request, seeds: list[int], extra) -> StepPlan:
    strategy, state = req.strategy, req.state
    return StepPlan(
        view_start=strategy.view_start(req.block[0], req.prompt_len), seeds=seeds, extra=extra,
        embed_edit=strategy.embed_edits(state, req.canvas, req.block),
        cfg_scale=strategy.cfg_scale, want_stats=strategy.wants_stats,
        masked_rows_only=strategy.masked_rows_only)
