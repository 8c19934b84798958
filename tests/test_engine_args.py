"""Every engine option is defined once (EngineConfig): LLM(...) keywords and the `serve` and
`generate` flags come from it, and `serve --dtype --page-size --kv-cache-memory-bytes` reach the
engine."""

from __future__ import annotations

import dataclasses

import pytest

from cover_vllm import LLM
from cover_vllm.config import EngineConfig
from cover_vllm.entrypoints.cli import build_parser
from cover_vllm.entrypoints.engine_flags import engine_options, flag_names
from cover_vllm.entrypoints.serve_cli import serve_args

# a non-default value for every option, as a flag would spell it
VALUES = {"decoding": "low_confidence", "kv_cache": "prefix", "dtype": "float32", "seed": "7",
          "tensor_parallel_size": "2", "distributed_executor_backend": "mp",
          "max_num_seqs": "3", "kv_cache_memory_bytes": "1048576", "memory_utilization": "0.5",
          "load_format": "dummy", "page_size": "8", "attention_backend": "reference",
          "cache_refresh": "adaptive", "num_threads": "2", "device": "meta",
          "distributed_timeout_s": "12.5", "enable_prefix_caching": "False"}


def _flag(option) -> list[str]:
    """A value flag and its value, or a switch (--name / --no-name) for a bool option."""
    name, value = flag_names(option)[0], VALUES[option.name]
    if option.metadata["kind"] == "bool":
        return [name if value == "True" else "--no-" + name.removeprefix("--")]
    return [name, value]


def _flags() -> list[str]:
    return [arg for o in engine_options() for arg in _flag(o)]


VALUES["quantization"] = "int8"            # weight-only quantized projections (issue 27)
# vLLM's common arguments (issue 26); gpu_memory_utilization agrees with memory_utilization
VALUES.update({"max_model_len": "64", "trust_remote_code": "True", "enforce_eager": "True",
               "fast_norm": "True",
               "batch_invariant": "True",
               "gpu_memory_utilization": "0.5", "tokenizer": "org/tokenizer",
               "revision": "v2", "tokenizer_revision": "v3", "download_dir": "/tmp/downloads"})


def test_every_engine_option_has_a_test_value():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {o.name for o in engine_options()} == set(VALUES)
    assert names - set(VALUES) == {"model", "cache_refresh_interval"}   # positional; deprecated


def test_serve_flags_reach_the_engine_config():
    args = serve_args(build_parser().parse_args(["serve", "cover-tiny", *_flags()]))
    got = args.engine
    assert got.model == "cover-tiny"
    for option in engine_options():
        assert str(getattr(got, option.name)) == VALUES[option.name], option.name


@pytest.mark.parametrize("command", [["generate", "cover-tiny", "--prompt", "x"], ["eval"],
                                     ["bench", "throughput"], ["bench", "latency"],
                                     ["serve", "cover-tiny"]])
def test_dtype_flag_everywhere(command):
    got = build_parser().parse_args([*command, "--dtype", "bfloat16"]).dtype
    # bench throughput compares dtypes (a list), like decodings and cache modes
    assert got == (("bfloat16",) if command == ["bench", "throughput"] else "bfloat16")


def test_generate_takes_every_engine_option():
    ns = build_parser().parse_args(["generate", "cover-tiny", "--prompt", "x", *_flags()])
    assert ns.page_size == 8 and ns.distributed_timeout_s == 12.5 and ns.num_threads == 2


def test_unknown_llm_keyword_names_the_valid_ones():
    with pytest.raises(TypeError, match="page_size"):
        LLM("cover-tiny", pagesize=8)


def test_serve_with_dtype_page_size_and_kv_budget_runs(tmp_path):
    """The options `serve` could not set before: the engine it builds uses them."""
    pytest.importorskip("fastapi")
    from cover_vllm.entrypoints.server import ServerThread

    ns = build_parser().parse_args(["serve", "cover-tiny", "--port", "0", "--threads", "1",
                                    "--dtype", "float32", "--page-size", "8",
                                    "--kv-cache-memory-bytes", str(1 << 20)])
    with ServerThread.from_args(serve_args(ns)) as server:
        engine = server.engine_loop.engine
        assert engine.config.page_size == 8 and engine.config.dtype == "float32"
        assert engine.config.kv_cache_memory_bytes == 1 << 20
