"""The command line as a newcomer meets it: defaults from the model, clear usage errors (exit 2),
token-id prompts, defaults in --help, and a thread default that does not oversubscribe."""

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cover_vllm.entrypoints.cli import build_parser, main
from cover_vllm.worker import threads


def _subcommand(*names: str) -> argparse.ArgumentParser:
    """The parser of `cover-vllm NAME [SUBNAME]`."""
    parser = build_parser()
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cover_vllm", *args], capture_output=True,
                          text=True, timeout=120)


def test_generate_cover_tiny_worked_addition_with_defaults():
    run = _cli("generate", "cover-tiny", "--prompt", "384+250=", "--chat")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("=634")
    assert "[stop]" in run.stderr


def test_generate_takes_token_ids(capsys):
    assert main(["generate", "cover-tiny", "--prompt-token-ids", "5,6,7", "--max-tokens", "8",
                 "--decoding", "low_confidence", "--threads", "1"]) == 0
    assert "[length] nfe=8" in capsys.readouterr().err


@pytest.mark.parametrize("family,decoding", [("sdar", "sdar"), ("llada2", "llada2")])
def test_generate_takes_token_ids_on_a_block_causal_model(family, decoding, capsys):
    """A golden block-causal checkpoint (no tokenizer): token ids in, token ids out."""
    from golden_cases import GOLDEN

    assert main(["generate", str(GOLDEN / family / "model"), "--prompt-token-ids", "5,6,7,8,9",
                 "--max-tokens", "8", "--decoding", decoding, "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    ids = [int(t) for t in out.split()]
    assert len(ids) == 8 and all(0 <= t < 300 for t in ids)
    assert "[length] nfe=" in err


# the server body's fields `generate` has no flag for, and why
NOT_GENERATE_FLAGS = {
    "model": "the positional MODEL", "prompt": "--prompt / --prompt-token-ids",
    "stream": "the CLI prints when done", "stream_options": "streaming only",
    "user": "OpenAI bookkeeping",
    "echo": "prompt scoring, not sampling (LLM.loglikelihood offline)",
    "continuation": "likelihood scoring (LLM.loglikelihood)",
    "mc_num": "likelihood scoring (LoglikelihoodParams.mc_num)",
    "mc_batch_size": "likelihood scoring (LoglikelihoodParams.batch_size)",
    "best_of": "refused by the server too", "suffix": "refused by the server too",
    "logit_bias": "refused by the server too",
    "response_format": "OpenAI's form of --structured-outputs",
    "return_token_ids": "token ids are printed for a model without a tokenizer",
}
BODY = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "n": 3, "logprobs": 2,
        "stop": ["\n", "=="], "seed": 4, "max_tokens": 16, "stop_token_ids": [9, 11],
        "ignore_eos": True, "block_length": 8, "steps": 8, "decoding_params": {"threshold": 0.8},
        "structured_outputs": {"regex": "[0-9]+"}, "frequency_penalty": 0.5,
        "presence_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2,
        "skip_special_tokens": False, "include_stop_str_in_output": True}
FLAGS = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--n", "3", "--logprobs", "2",
         "--stop", "\n", "--stop", "==", "--seed", "4", "--max-tokens", "16",
         "--stop-token-ids", "9,11", "--ignore-eos", "--block-length", "8", "--steps", "8",
         "--decoding-params", '{"threshold": 0.8}', "--structured-outputs", '{"regex": "[0-9]+"}',
         "--frequency-penalty", "0.5", "--presence-penalty", "-0.5", "--repetition-penalty",
         "1.2", "--min-p", "0.1", "--min-tokens", "2", "--no-skip-special-tokens",
         "--include-stop-str-in-output"]


def test_generate_has_a_flag_for_every_sampling_field_of_the_server():
    """Every field of the completions body is a `generate` flag under vLLM's spelling
    (--top-p for top_p), or listed above with the reason it is not; decoding, kv_cache and
    cache_refresh are the engine flags of the same names."""
    pytest.importorskip("pydantic")
    from cover_vllm.entrypoints.server.protocol import CompletionRequest

    actions = _subcommand("generate")._option_string_actions
    missing = [f for f in CompletionRequest.model_fields if f not in NOT_GENERATE_FLAGS
               and "--" + f.replace("_", "-") not in actions]
    assert not missing, missing


def test_generate_flags_make_the_servers_sampling_params():
    """The same values as flags and as a completions body give equal SamplingParams."""
    pytest.importorskip("pydantic")
    from cover_vllm.entrypoints.generate_cli import _sampling_params
    from cover_vllm.entrypoints.server.protocol import CompletionRequest

    server = CompletionRequest(prompt="x", **BODY).sampling_params(BODY["max_tokens"])
    args = build_parser().parse_args(["generate", "cover-tiny", "--prompt", "x", *FLAGS])
    assert _sampling_params(args) == server


def test_generate_prints_n_outputs_and_their_logprobs(capsys):
    from cover_vllm import LLM, SamplingParams

    argv = ["generate", "cover-tiny", "--prompt", "384+250=", "--chat", "--n", "3",
            "--temperature", "1.0", "--top-k", "4", "--seed", "7", "--logprobs", "2",
            "--stop", "\n", "--threads", "1"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    llm = LLM("cover-tiny", num_threads=1)
    (ref,) = llm.chat([{"role": "user", "content": "384+250="}], SamplingParams(
        max_tokens=32, n=3, temperature=1.0, top_k=4, seed=7, logprobs=2, stop=["\n"]),
        use_tqdm=False)
    lines = out.splitlines()
    for c in ref.outputs:                  # header, text, logprob header, one line per token
        head = lines.index(f"[output {c.index}] finish_reason={c.finish_reason}"
                           + ("" if c.stop_reason is None else f" stop_reason={c.stop_reason!r}")
                           + f" tokens={len(c.token_ids)}")
        assert lines[head + 1] == c.text
        assert lines[head + 2].split() == ["pos", "token", "logprob", "rank", "top", "2"]
        rows = [r.split() for r in lines[head + 3:head + 3 + len(c.token_ids)]]
        for pos, (row, t) in enumerate(zip(rows, c.token_ids)):
            chosen = c.logprobs[pos][t]
            assert row[:4] == [str(pos), repr(chosen.decoded_token), f"{chosen.logprob:.3f}",
                               str(chosen.rank)]
    assert sum(line.startswith("[output ") for line in lines) == 3
    assert "nfe=" in err


@pytest.mark.parametrize("flags,words", [
    (["--n", "100000"], "n (outputs per prompt) must be an integer from 1 to 64"),
    (["--n", "0"], "from 1 to 64"), (["--logprobs", "21"], "logprobs"),
    (["--top-p", "0"], "top_p"), (["--top-k", "-2"], "top_k"),
    (["--structured-outputs", '{"regex": "a", "choice": ["b"]}'], "exactly one of")])
def test_generate_refuses_bad_sampling_flags_naming_the_field(flags, words, capsys):
    assert main(["generate", "cover-tiny", "--prompt", "hi", *flags]) == 2
    assert words in capsys.readouterr().err


README = Path(__file__).resolve().parents[1] / "README.md"
# the README defaults table's columns: the commands whose --help each one speaks for
COLUMNS = {"`LLM(...)`": [], "`generate`": [("generate",)], "`serve`": [("serve",)],
           "`eval`": [("eval",)],
           "`bench throughput`, `bench latency`": [("bench", "throughput"), ("bench", "latency")]}


def _readme_defaults() -> dict[str, dict[str, str]]:
    """README's defaults table: {option: {column: cell}}."""
    rows = [line.strip().strip("|").split("|") for line in README.read_text().splitlines()
            if line.startswith("| option |") or line.startswith("| `")]
    head = next(r for r in rows if r[0].strip() == "option")
    table = {}
    for r in rows:
        if len(r) == len(head) and r[0].strip() != "option":
            table[r[0].strip().strip("`")] = {h.strip(): c.strip()
                                              for h, c in zip(head[1:], r[1:])}
    return table


def _help(parser: argparse.ArgumentParser, dest: str) -> tuple[object, str]:
    """An option's default and its help text as --help prints it."""
    action = next(a for a in parser._actions if a.dest == dest)
    text = argparse.HelpFormatter("cover-vllm")._expand_help(action)
    default = action.default
    return (",".join(default) if isinstance(default, tuple) else default), " ".join(text.split())


@pytest.mark.parametrize("option", ["decoding", "kv_cache", "cache_refresh", "dtype"])
def test_readme_defaults_agree_with_the_config_and_every_help(option):
    """README's table of defaults per command: `LLM(...)` against EngineConfig, each command
    against its parser's default and what its --help says about it."""
    from cover_vllm.config import EngineConfig

    from cover_vllm.models.registry import Family

    # an unset `decoding` is the model family's (registry); every masked family's is the
    # Family default, what the README's table states
    unset = Family.__dataclass_fields__["default_decoding"].default if option == "decoding" \
        else None
    cells = _readme_defaults()[option]
    assert set(cells) == set(COLUMNS)
    for column, commands in COLUMNS.items():
        value = cells[column].strip("`")
        if not commands:
            default = EngineConfig.__dataclass_fields__[option].default
            assert (unset if default is None else default) == value, column
        for names in commands:
            default, text = _help(_subcommand(*names), option)
            if names[0] == "bench" and default is None:       # benchmarks/throughput.py's
                from cover_vllm.benchmarks.throughput import default_decodings
                default = ",".join(default_decodings("cover-tiny"))
            default = unset if default is None else default
            assert default == value, (names, default, value)
            assert f"default: {value})" in text or f"{value} (default)" in text, (names, text)


def test_readme_max_tokens_defaults_agree_with_the_code():
    from cover_vllm import SamplingParams
    from cover_vllm.entrypoints.server.protocol import (DEFAULT_CHAT_TOKENS,
                                                        DEFAULT_COMPLETION_TOKENS)

    numbers = {column: sorted(int(n) for n in re.findall(r"\b\d+\b", cell))
               for column, cell in _readme_defaults()["max_tokens"].items()}
    fallback = SamplingParams().max_tokens
    assert numbers["`LLM(...)`"] == numbers["`generate`"] == [fallback]
    assert f"else {fallback})" in _help(_subcommand("generate"), "max_tokens")[1]
    assert numbers["`serve`"] == sorted([DEFAULT_COMPLETION_TOKENS, DEFAULT_CHAT_TOKENS])
    assert numbers["`eval`"] == []
    assert "--max-tokens" not in _subcommand("eval")._option_string_actions
    for names in COLUMNS["`bench throughput`, `bench latency`"]:
        assert [_help(_subcommand(*names), "output_len")[0]] == numbers[
            "`bench throughput`, `bench latency`"]


@pytest.mark.parametrize("argv,field", [
    (["generate", "cover-tiny", "--prompt", "hi", "--threads", "0"], "--threads"),
    (["eval", "--threads", "0"], "--threads"),
    (["bench", "latency", "--threads", "-1"], "--threads"),
    (["serve", "cover-tiny", "--threads", "0"], "--threads"),
    (["generate", "cover-tiny", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["eval", "--num", "zero"], "--num"),
])
def test_bad_numbers_are_usage_errors(argv, field, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and field in capsys.readouterr().err


def test_weightless_shape_without_dummy_says_so(capsys):
    assert main(["generate", "llada-8b", "--prompt", "hi"]) == 2
    assert "load_format='dummy'" in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    for argv in (["generate", "--help"], ["serve", "--help"], ["bench", "throughput", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: 0.0)" in text or "default: dual" in text, argv
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    assert "(default: 200)" in " ".join(capsys.readouterr().out.split())


def test_thread_default_never_oversubscribes(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    assert threads.default_num_threads(hidden_size=128) == 1          # tiny: dispatch-bound
    monkeypatch.setattr(threads, "busy_cores_elsewhere", lambda: 0.1)
    assert threads.default_num_threads(hidden_size=4096) == 2         # idle machine
    assert threads.default_num_threads(hidden_size=4096, num_ranks=2) == 1
    monkeypatch.setattr(threads, "busy_cores_elsewhere", lambda: 1.2)
    assert threads.default_num_threads(hidden_size=4096) == 1         # another job runs
    monkeypatch.setattr(threads, "busy_cores_elsewhere", lambda: 7.0)
    assert threads.default_num_threads(hidden_size=4096) == 1


def test_busy_cores_leave_out_this_process(monkeypatch):
    """Machine-wide busy time minus this process's own, as cores: 80 busy jiffies of 100 on
    2 cores, 30 of them this process's -> 1.0 core busy elsewhere."""
    readings = iter([(1000, 5000, 10), (1080, 5100, 40)])
    monkeypatch.setattr(threads, "_busy_jiffies", lambda: next(readings))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    assert threads.busy_cores_elsewhere() == pytest.approx(1.0)


def test_busy_cores_see_another_process():
    """A process spinning beside this one shows up while this one sleeps; anything else running
    only adds to the count."""
    if threads._busy_jiffies() is None:
        pytest.skip("no /proc on this system")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)                                        # the child is running
        assert threads.busy_cores_elsewhere(window_s=0.5) >= 0.5
    finally:
        spin.kill()
        spin.wait()
