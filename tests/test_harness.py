"""lm-evaluation-harness 0.4.13 (the `eval` extra): the `cover_vllm` model beside lm-eval's own,
its entry point, a local multiple-choice task built from held-out arith problems (acc >= 0.9)
and a local generation task, `cover-vllm lm-eval`, and lm-eval's `local-completions` against
`cover-vllm serve`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the 'eval' extra (lm_eval) is not installed")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")          # local JSON tasks only
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import cover_vllm.harness as harness  # noqa: E402
from cover_vllm import LLM, LoglikelihoodParams  # noqa: E402
from cover_vllm.models.builtin import BUILTIN_DIRS  # noqa: E402
from cover_vllm.tasks.choices import arith_choices, chat_context, write_lm_eval_tasks  # noqa

NUM_PROBLEMS = 20


@pytest.fixture(scope="module")
def llm():
    return LLM("cover-tiny")


@pytest.fixture(scope="module")
def problems(llm):
    return arith_choices(NUM_PROBLEMS, chat_context(llm.get_tokenizer()))


@pytest.fixture(scope="module")
def task_dir(problems, tmp_path_factory) -> Path:
    return write_lm_eval_tasks(problems, tmp_path_factory.mktemp("lm_eval_tasks"))


def _tasks(task_dir: Path):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)


def test_registered_beside_lm_evals_own_models() -> None:
    from lm_eval.api.registry import get_model, model_registry

    assert get_model("cover_vllm") is harness.CoverVLLM
    assert "hf" in model_registry and "local-completions" in model_registry


def test_entry_point_resolves_to_the_model() -> None:
    import importlib.metadata as md

    points = [e for e in md.entry_points(group="lm_eval.models") if e.name == "cover_vllm"]
    assert len(points) == 1 and points[0].load() is harness.CoverVLLM


def test_correct_answer_scores_highest(llm, problems) -> None:
    """The done-when's rate at mc_num 32 on 20 held-out problems (docs/benchmarks.md has 100
    problems at 32 and 128)."""
    reqs = [(p.context, c) for p in problems for c in p.choices]
    outs = llm.loglikelihood(reqs, LoglikelihoodParams(mc_num=32, batch_size=32, seed=0),
                             use_tqdm=False)
    k = len(problems[0].choices)
    right = sum(max(range(k), key=lambda j: outs[i * k + j].logprob) == p.label
                for i, p in enumerate(problems))
    assert right / len(problems) >= 0.9


def test_simple_evaluate_multiple_choice_and_generation(task_dir) -> None:
    results = lm_eval.simple_evaluate(
        model="cover_vllm",
        model_args="pretrained=cover-tiny,mc_num=32,batch_size=32,check_greedy=False,"
                   "decoding=threshold,threshold=0.9",
        tasks=["cover_arith_mc", "cover_arith_gen"], task_manager=_tasks(task_dir),
        limit=10)["results"]
    assert results["cover_arith_mc"]["acc,none"] >= 0.9
    assert results["cover_arith_gen"]["exact_match,sum"] >= 0.5


def test_model_args_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="mc_num"):
        harness.CoverVLLM.create_from_arg_string("pretrained=cover-tiny,mc_num=10,batch_size=4")


@pytest.mark.slow   # a fresh interpreter; lm-eval's CLI indexes its built-in tasks
def test_cover_vllm_lm_eval_command(task_dir, tmp_path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "cover_vllm", "lm-eval", "--model", "cover_vllm",
         "--model_args", "pretrained=cover-tiny,mc_num=8,batch_size=8,check_greedy=False",
         "--tasks", "cover_arith_mc", "--include_path", str(task_dir), "--limit", "4",
         "--output_path", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cover_arith_mc" in proc.stdout and "acc" in proc.stdout


def test_local_completions_against_the_server(task_dir) -> None:
    """lm-eval's own OpenAI-completions client (echo + logprobs, max_tokens 1) scores the
    multiple-choice task through `cover-vllm serve`: the chain-rule values (server/scoring.py)."""
    pytest.importorskip("fastapi")
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_helpers import start_server

    server = start_server("cover-tiny")
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=test-model,tokenizer={BUILTIN_DIRS['cover-tiny']},"
                       f"base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                       "max_retries=1",
            tasks=["cover_arith_mc"], task_manager=_tasks(task_dir), limit=10)["results"]
    finally:
        server.stop()
    assert results["cover_arith_mc"]["acc,none"] >= 0.9


def test_loglikelihood_rolling_windows_and_generate_until() -> None:
    """A text longer than the model's max length is scored in disjoint windows (their sum);
    generate_until stops at the task's `until` and honours a decoder knob from model_args."""
    from types import SimpleNamespace

    lm = harness.CoverVLLM.create_from_arg_string(
        "pretrained=cover-tiny,mc_num=8,batch_size=8,decoding=threshold,threshold=0.9")
    limit = lm.llm.engine.spec.max_model_len
    short, long = "384+250=634\n", "1+2=3\n" * (limit // 2)
    assert len(lm.tokenizer.encode(long, add_special_tokens=False)) > limit
    values = lm.loglikelihood_rolling([SimpleNamespace(args=(short,)),
                                       SimpleNamespace(args=(long,))], disable_tqdm=True)
    assert all(v < 0 for v in values) and values[1] < values[0]
    ctx = chat_context(lm.tokenizer)("384+250=")
    text, = lm.generate_until([SimpleNamespace(args=(ctx, {"until": ["\n"],
                                                            "max_gen_toks": 32}))],
                              disable_tqdm=True)
    assert "\n" not in text and text
    assert lm.llm.engine.stage.strategy("threshold", {"threshold": 0.9}) is not None
