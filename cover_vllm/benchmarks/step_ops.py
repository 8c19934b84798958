"""Ops per engine step of a bench row's own workload (`bench throughput --count-ops`, issue #42).

One extra, untimed run of the row's first batch of prompts, stepped one `Engine.step()` at a time
under `OpCounter` (benchmarks/op_count.py), with a second counter around the executor call:

* `device_ops_per_step`: aten ops with an output on a device other than the host, the whole step
  (views included): on CUDA, the step's kernel launches plus its views' dispatches. None for a
  CPU engine, which has no device apart from the host. `launches_per_step`: those that are not
  views, about one kernel launch each (an op may launch none or several: this counts ops).
* `host_ops_per_step`: ops whose outputs all live on the host (on a CPU engine: every op).
* `forward_ops_per_step`: ops dispatched inside the executor call (batch layout and the model
  forward), whatever their device: on CUDA the forward's launches, on the CPU its per-op cost.

Counts are the driver's: the ops of other tensor-parallel ranks (other processes) and of other
threads are not seen. Means are over the steps that ran the model.

`decide_ms_per_step`: on a CPU engine, the decoders' work on the logits (engine/timing.py) from
one more untimed pass, since timing every op slows the host's share of the steps it times.
"""

from __future__ import annotations

import statistics

from cover_vllm.benchmarks.op_count import OpCounter
from cover_vllm.engine.observer import StepTimes


class _CountedForward:
    """Wraps an executor's `execute_model`: counts the ops of each call into `calls`."""

    def __init__(self, execute):
        self.execute, self.calls = execute, []

    def __call__(self, out):
        with OpCounter() as ops:
            result = self.execute(out)
        self.calls.append(ops.num_device + ops.num_host)
        return result


def count_row_ops(llm, prompts: list, params) -> dict:
    """Run `prompts` with `params` through `llm`'s engine step by step, counting every step;
    returns the per-step means (module docstring) and the steps counted."""
    engine, executor = llm.engine, llm.engine.executor
    own = vars(executor).get("execute_model")          # an instance wrapper already there
    counted = _CountedForward(executor.execute_model)
    executor.execute_model = counted
    steps = []
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"count-ops-{i}", prompt, params)
        while engine.has_unfinished_requests():
            calls = len(counted.calls)
            with OpCounter() as ops:
                engine.step()
            if len(counted.calls) > calls:                    # the step ran the model
                steps.append((ops.num_device, ops.num_device - ops.views, ops.num_host,
                              counted.calls[-1]))
    finally:
        if own is None:
            del executor.execute_model                        # the class's method again
        else:
            executor.execute_model = own
    cpu = engine.device.type == "cpu"
    mean = [statistics.mean(s[k] for s in steps) if steps else None for k in range(4)]
    return {"device_ops_per_step": None if cpu else mean[0],
            "launches_per_step": None if cpu else mean[1], "host_ops_per_step": mean[2],
            "forward_ops_per_step": mean[3], "counted_steps": len(steps)}


def decide_ms_per_step(llm, prompts: list, params) -> float | None:
    """ms per step the decoders spent in aten ops on the logits (`StepRecord.decide_device`),
    the mean over one untimed run of `prompts` with the CPU engine's op timer on (every op of
    the strategy phase dispatched through Python, so that run's other phases read slow); None
    off the CPU (CUDA times it with events in the timed run itself; meta has no such work)."""
    engine = llm.engine
    if engine.device.type != "cpu":
        return None
    llm.reset_prefix_cache()            # the pass decodes what the timed run decoded
    times = StepTimes(times_logits=True)
    engine.add_observer(times)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.remove_observer(times)
    return 1e3 * sum(r["decide_device"] for r in times.rows) / max(len(times.rows), 1)
