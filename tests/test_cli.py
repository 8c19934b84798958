"""The command line as a newcomer meets it: defaults from the model, clear usage errors (exit 2),
token-id prompts, defaults in --help, and a thread default that does not oversubscribe."""

import subprocess
import sys
import time

import pytest

from cover_vllm.entrypoints.cli import build_parser, main
from cover_vllm.worker import threads


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
