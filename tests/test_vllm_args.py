"""vLLM's common engine arguments as a vLLM user types them: `trust_remote_code`,
`max_model_len`, `gpu_memory_utilization`, `enforce_eager`, `seed`, `get_tokenizer()`; vLLM's
arguments with no meaning here refused by name with the reason (LLM and the command line)."""

from __future__ import annotations

import logging

import pytest

from cover_vllm import LLM, SamplingParams
from cover_vllm.config import EngineConfig
from cover_vllm.entrypoints.cli import build_parser, main
from cover_vllm.entrypoints.serve_cli import serve_args
from cover_vllm.vllm_args import VLLM_ONLY, check_vllm_args
from cover_vllm.worker.memory import host_memory_bytes

CHAT = [{"role": "user", "content": "384+250="}]


@pytest.fixture(scope="module")
def capped() -> LLM:
    return LLM("cover-tiny", trust_remote_code=True, max_model_len=64, seed=3,
               enforce_eager=True, num_threads=1)


def test_vllm_style_llm_works(capped):
    assert capped.engine.spec.max_model_len == 64
    assert capped.engine.memory.canvas_tokens == 64          # the cap sizes the memory plan
    assert capped.chat(CHAT, use_tqdm=False)[0].outputs[0].text.endswith("=634")


def test_trust_remote_code_is_logged_once(caplog):
    from cover_vllm.engine import engine

    engine._log_trust_remote_code.cache_clear()
    with caplog.at_level(logging.INFO, logger="cover_vllm"):
        for _ in range(2):
            LLM("cover-tiny", trust_remote_code=True, num_threads=1)
    said = [r.getMessage() for r in caplog.records if "trust_remote_code" in r.getMessage()]
    assert len(said) == 1 and "never runs code shipped with a checkpoint" in said[0]


@pytest.mark.parametrize("alias, dtype", [("half", "float16"), ("float", "float32")])
def test_vllms_dtype_spellings(alias, dtype):
    from cover_vllm.config import EngineConfig
    from cover_vllm.entrypoints.cli import build_parser

    assert EngineConfig.from_options("cover-tiny", dtype=alias).dtype == dtype
    args = build_parser().parse_args(["generate", "cover-tiny", "--prompt", "x", "--dtype", alias])
    assert EngineConfig.from_options("cover-tiny", dtype=args.dtype).dtype == dtype


def test_get_tokenizer_round_trips_text(capped):
    tokenizer = capped.get_tokenizer()
    for text in ("384+250=", "solve: 2 apples + 3 apples", "4x4 sudoku 1.3. .2.4"):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_max_model_len_beyond_the_model_is_refused():
    with pytest.raises(ValueError, match=r"max_model_len=256 exceeds the model's maximum "
                                         r"length 128"):
        LLM("cover-tiny", max_model_len=256)
    with pytest.raises(ValueError, match="max_model_len must be a positive int"):
        EngineConfig("cover-tiny", max_model_len=0)


def test_a_request_over_max_model_len_is_refused(capped):
    with pytest.raises(ValueError, match=r"72-token canvas, beyond the engine's max length "
                                         r"max_model_len=64"):
        capped.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=32),
                        use_tqdm=False)
    capped.generate({"prompt_token_ids": [5] * 32}, SamplingParams(max_tokens=32),
                    use_tqdm=False)                        # exactly 64 fits


def test_an_over_long_request_names_the_field_at_fault(capped):
    """A prompt that leaves no room for one token is the prompt's fault; a prompt that fits
    with too many max_tokens is max_tokens' (the server's 400 names the same field)."""
    with pytest.raises(ValueError, match=r"^prompt \(64 tokens\) leaves no room for a "
                                         r"generated token .* max_model_len=64"):
        capped.generate({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=1),
                        use_tqdm=False)
    with pytest.raises(ValueError, match=r"^max_tokens \(32\) \+ prompt \(40 tokens\) .* "
                                         r"give max_tokens <= 24"):
        capped.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=32),
                        use_tqdm=False)
    assert not capped.engine.has_unfinished_requests()


def test_an_over_long_request_on_a_block_causal_model_counts_whole_blocks():
    """SDAR's canvas ends on a block boundary: with 32-token blocks and max_model_len=64 a
    33-token prompt leaves room for 31 tokens, a 64-token one for none."""
    from golden_cases import GOLDEN

    llm = LLM(str(GOLDEN / "sdar" / "model"), max_model_len=64, decoding="sdar", num_threads=1)
    params = SamplingParams(max_tokens=32, block_length=32)
    with pytest.raises(ValueError, match=r"^max_tokens .* a 96-token canvas.* <= 31"):
        llm.generate({"prompt_token_ids": [5] * 33}, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt \(64 tokens\) leaves no room"):
        llm.generate({"prompt_token_ids": [5] * 64}, params, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5] * 33}, SamplingParams(
        max_tokens=31, block_length=32, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 31


def test_seed_makes_sampling_reproducible():
    """As in vLLM: the same engine seed and the same requests give the same samples."""
    params = SamplingParams(max_tokens=16, temperature=1.0, decoding="low_confidence")

    def run(seed: int) -> list:
        outs = LLM("cover-tiny", seed=seed, num_threads=1).generate(["384+250="] * 2, params,
                                                                    use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    first = run(3)
    assert run(3) == first and first[0] != first[1]


def test_gpu_memory_utilization_is_memory_utilization_under_vllms_name():
    llm = LLM("cover-tiny", gpu_memory_utilization=0.5, num_threads=1)
    assert llm.engine.memory.capacity_bytes == int(0.5 * host_memory_bytes())   # CPU: host
    assert EngineConfig("m", memory_utilization=0.4).memory_fraction == 0.4
    assert EngineConfig("m").memory_fraction == 0.9
    assert EngineConfig("m", memory_utilization=0.5, gpu_memory_utilization=0.5).memory_option \
        == "memory_utilization=0.5"
    with pytest.raises(ValueError, match="disagree: they are one fraction under two names"):
        EngineConfig("m", memory_utilization=0.5, gpu_memory_utilization=0.6)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction"):
        EngineConfig("m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1e-09 of the host memory"):
        LLM("cover-tiny", gpu_memory_utilization=1e-9)


def test_a_vllm_argument_with_no_meaning_is_refused_by_name():
    with pytest.raises(ValueError, match=r"swap_space=4: the KV pool is never swapped"):
        LLM("cover-tiny", swap_space=4)
    with pytest.raises(ValueError) as err:
        LLM("cover-tiny", enable_lora=True, kv_cache_dtype="fp8")
    assert "enable_lora=True: no LoRA" in str(err.value)
    assert "kv_cache_dtype='fp8'" in str(err.value) and "accepted only as 'auto'" in str(err.value)
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['pagesize'\]"):
        LLM("cover-tiny", pagesize=8)                      # not vLLM's either


def test_a_vllm_argument_asking_for_what_the_engine_does_is_accepted():
    options = dict(pipeline_parallel_size=1, kv_cache_dtype="auto", enable_lora=False,
                   swap_space=0, disable_log_stats=True, tokenizer_mode="auto", seed=1)
    assert check_vllm_args(options) == {"seed": 1}
    assert all(entry.reason or entry.same for entry in VLLM_ONLY.values())


def test_cli_flags_use_vllms_spelling(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--trust-remote-code", "--max-model-len", "--gpu-memory-utilization",
                 "--enforce-eager", "--tokenizer", "--revision", "--tokenizer-revision",
                 "--download-dir", "--seed"):
        assert flag in text, flag
    assert "--swap-space" not in text                    # vLLM-only flags stay hidden


def test_cli_refuses_a_vllm_flag_with_the_reason(capsys):
    ns = build_parser().parse_args(["serve", "cover-tiny", "--swap-space", "4",
                                    "--pipeline-parallel-size", "1"])
    with pytest.raises(ValueError, match="swap_space=4") as err:
        serve_args(ns)
    assert "pipeline_parallel_size" not in str(err.value)  # 1 asks for what the engine does
    ns = build_parser().parse_args(["serve", "cover-tiny", "--no-enable-lora",
                                    "--pipeline-parallel-size", "1", "--kv-cache-dtype", "auto",
                                    "--served-model-name", "tiny"])
    assert serve_args(ns).served_model_name == "tiny"
    assert main(["generate", "cover-tiny", "--prompt", "hi", "--enable-lora"]) == 2
    assert "enable_lora=True: no LoRA adapters" in capsys.readouterr().err
