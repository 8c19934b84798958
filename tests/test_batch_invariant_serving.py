"""The batch-invariant mode (issue #51) from the outside: its flags, switch and log line, the
server (a request's text and logprobs alone and under 32 concurrent clients), lm-eval's scores
with batch_size 1 and 32, the throughput bench's rows beside the default, tensor parallelism,
and CUDA (where present)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from cover_vllm.config import EngineConfig
from cover_vllm.entrypoints.cli import build_parser
from cover_vllm.entrypoints.engine_flags import engine_kwargs


@pytest.mark.parametrize("argv", [["serve", "cover-tiny"],
                                  ["generate", "cover-tiny", "--prompt", "hi"],
                                  ["eval", "--model", "cover-tiny"]])
def test_flag_on_serve_generate_eval(argv):
    parser = build_parser()
    assert parser.parse_args(argv + ["--batch-invariant"]).batch_invariant is True
    assert parser.parse_args(argv).batch_invariant is False
    if argv[0] != "eval":
        assert engine_kwargs(parser.parse_args(argv + ["--batch-invariant"]))["batch_invariant"]


def test_bench_throughput_flag_adds_the_mode_beside_the_default():
    from cover_vllm.entrypoints.cli import _bench_spec

    args = build_parser().parse_args(["bench", "throughput", "--batch-invariant"])
    assert _bench_spec(args).batch_invariant == (False, True)
    args = build_parser().parse_args(["bench", "throughput"])
    assert _bench_spec(args).batch_invariant == (False,)


def test_off_by_default_and_vllm_env_switch(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert EngineConfig(model="cover-tiny").batch_invariant is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig(model="cover-tiny").batch_invariant is True
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(model="cover-tiny", batch_invariant="yes")


def test_server_gives_the_same_answer_alone_and_under_32_clients():
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from serve_helpers import openai_client, start_server

    server = start_server("cover-tiny", batch_invariant=True,
                          num_threads=1, kv_cache_memory_bytes=64 << 20)
    try:
        client = openai_client(server)

        def ask(prompt: str, max_tokens: int, decoding: str):
            resp = client.completions.create(
                model="test-model", prompt=prompt, max_tokens=max_tokens, temperature=0,
                logprobs=1, extra_body={"decoding": decoding, "block_length": 4})
            choice = resp.choices[0]
            return choice.text, choice.logprobs.token_logprobs

        needle = ("What is 7 + 5?", 8, "cover")
        alone = ask(*needle)
        others = [(f"Question {i}: add {i} and {2 * i}." * (1 + i % 3), 4 + 4 * (i % 3),
                   ("threshold", "low_confidence", "cover", "wino", "saber")[i % 5])
                  for i in range(31)]
        with cf.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(ask, *o) for o in others[:16]]
            futures.append(pool.submit(ask, *needle))
            futures += [pool.submit(ask, *o) for o in others[16:]]
            results = [f.result() for f in futures]
        assert results[16] == alone
    finally:
        server.stop()


def test_lm_eval_scores_equal_with_batch_size_1_and_32(tmp_path):
    """lm-eval's batch_size 1 and 32, the engine running 1 and 32 requests at once. (The
    model_args batch_size is the Monte-Carlo estimator's mini-batch, which defines the
    estimate: one mask count is drawn per mini-batch, as in the official LLaDA estimator; it
    stays 8 on both sides.)"""
    lm_eval = pytest.importorskip("lm_eval")
    import cover_vllm.harness  # noqa: F401  (registers the model)
    from lm_eval.tasks import TaskManager

    from cover_vllm import LLM
    from cover_vllm.tasks.choices import arith_choices, chat_context, write_lm_eval_tasks

    problems = arith_choices(4, chat_context(LLM("cover-tiny").get_tokenizer()))
    tasks = TaskManager(include_path=str(write_lm_eval_tasks(problems, tmp_path)),
                        include_defaults=False)

    def evaluate(batch: int):
        out = lm_eval.simple_evaluate(
            model="cover_vllm", tasks=["cover_arith_mc"], task_manager=tasks, limit=4,
            batch_size=batch, log_samples=True,
            model_args=f"pretrained=cover-tiny,mc_num=8,batch_size=8,max_num_seqs={batch},"
                       "check_greedy=False,batch_invariant=True,num_threads=1")
        samples = [s["resps"] for s in out["samples"]["cover_arith_mc"]]
        return out["results"]["cover_arith_mc"], samples

    one, thirty_two = evaluate(1), evaluate(32)
    assert one == thirty_two


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_needle_on_cuda():
    import test_batch_invariant as t
    from needle import Family

    family = Family(dict(model="llada-50m", load_format="dummy", dtype="bfloat16",
                         device="cuda"), t.STRATEGIES, (5, 16000), dict(block_length=4))
    t.FAMILIES["cuda"] = family
    try:
        assert t.check("cuda", invariant=True) == []
    finally:
        del t.FAMILIES["cuda"]


def test_startup_log_says_the_mode_is_on(caplog):
    import logging

    from cover_vllm import LLM

    with caplog.at_level(logging.INFO):
        LLM("cover-tiny", batch_invariant=True, num_threads=1).shutdown()
    assert "batch-invariant mode on" in caplog.text


def test_tensor_parallel_needle_keeps_tokens_and_logprobs():
    """tensor_parallel_size=2 (worker processes enter the mode themselves): the needle's tokens
    and logprobs alone and in a batch of 16 are equal (across TP sizes they may differ)."""
    import random

    from cover_vllm import LLM, SamplingParams

    llm = LLM("cover-tiny", tensor_parallel_size=2, batch_invariant=True, num_threads=1,
              kv_cache_memory_bytes=64 << 20)
    try:
        params = SamplingParams(max_tokens=8, block_length=4, decoding="cover", logprobs=2,
                                seed=7)
        needle = [11, 42, 7, 99, 23]
        alone = llm.generate([needle], params, use_tqdm=False)[0].outputs[0]
        rng = random.Random(0)
        others = [[rng.randrange(5, 200) for _ in range(rng.randrange(2, 40))]
                  for _ in range(15)]
        batch = llm.generate(others[:7] + [needle] + others[7:], params, use_tqdm=False)
        assert (batch[7].outputs[0].token_ids, batch[7].outputs[0].logprobs) == \
            (alone.token_ids, alone.logprobs)
    finally:
        llm.shutdown()
