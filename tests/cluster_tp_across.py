"""Run by tests/test_cluster_netns.py as a process of node A: a TP=2 engine whose rank 1 is
forced onto the other node (RayRanks.strategy = "STRICT_SPREAD": its group's two bundles on
distinct nodes), so the gloo group forms between the two hosts; prints one JSON line with the
driver's node, where rank 1 ran and the address its group sockets used, and the tokens of TP=2
and of TP=1 for the same prompts."""

import json
import sys

import ray

from cover_vllm import LLM, SamplingParams
from cover_vllm.executor.placement import current_node
from cover_vllm.executor.ray_ranks import RayRanks

PROMPTS = ["what is 1 + 2 ?", "hello world", "the sum of 3 and 4 is"]


def main(address: str) -> None:
    ray.init(address=address, configure_logging=False, log_to_driver=False)
    RayRanks.strategy = "STRICT_SPREAD"
    params = SamplingParams(max_tokens=16, temperature=0.0, block_length=8, ignore_eos=True)
    with LLM("cover-tiny", tensor_parallel_size=2, distributed_executor_backend="ray",
             num_threads=1) as llm:
        ranks = llm.engine.executor.placement
        tp2 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM("cover-tiny", num_threads=1) as llm:
        tp1 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    driver = current_node()
    print(json.dumps({"driver": [driver.node_id, driver.ip], "ranks": ranks, "tp2": tp2,
                      "tp1": tp1}))


if __name__ == "__main__":
    main(sys.argv[1])
