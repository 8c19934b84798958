"""`cover-vllm eval` on the shipped cover-tiny: its accuracy agrees with an independent check,
and `--baseline` pairs two runs problem by problem."""

import json
from dataclasses import asdict

import pytest

from cover_vllm import LLM
from cover_vllm.entrypoints.cli import main
from cover_vllm.eval import EvalRow, compare, evaluate_one, row_key, sign_test
from cover_vllm.tasks import get_task


def _independent_sudoku_ok(prompt: str, text: str) -> bool:
    """Written here, not imported: 4 rows of 4 digits, givens kept, rows/cols/boxes a permutation."""
    rows = text.strip().split("\n")
    givens = prompt.split("\n")[1:]
    if len(rows) != 4 or any(len(r) != 4 or not set(r) <= set("1234") for r in rows):
        return False
    if any(g != "_" and g != c for grow, row in zip(givens, rows) for g, c in zip(grow, row)):
        return False
    cols = ["".join(r[c] for r in rows) for c in range(4)]
    boxes = ["".join(rows[r][c] for r in (br, br + 1) for c in (bc, bc + 1))
             for br in (0, 2) for bc in (0, 2)]
    return all(sorted(u) == list("1234") for u in rows + cols + boxes)


def _independent_arith_ok(prompt: str, text: str) -> bool:
    """Written here, not imported: the column lines add the right digits (either order) and
    carries, and the last line is the sum."""
    a, b = prompt.rstrip("=").split("+")
    lines = text.strip().split("\n")
    if len(lines) != 4 or lines[3] != f"={int(a) + int(b)}":
        return False
    carry = 0
    for col, line in enumerate(lines[:3]):
        ok = (len(line) == 8 and line[1] == "+" and line[3] == "+" and line[5] == "="
              and sorted(line[0] + line[2]) == sorted(a[2 - col] + b[2 - col])
              and line[4] == str(carry)
              and line[6:].isdigit() and int(line[6:]) == int(line[0]) + int(line[2]) + carry)
        if not ok:
            return False
        carry = int(line[6])
    return True


@pytest.mark.parametrize("task_name,decoding,k", [("sudoku4", "low_confidence", 4),
                                                  ("sudoku4", "cover", None),
                                                  ("arith", "low_confidence", 4),
                                                  ("arith", "cover", None)])
def test_eval_accuracy_matches_an_independent_verifier(task_name, decoding, k):
    task = get_task(task_name)
    examples = task.eval_split(24)
    llm = LLM("cover-tiny")
    row, outs = evaluate_one(llm, task, examples, decoding, k, None, use_tqdm=False)
    check = _independent_sudoku_ok if task_name == "sudoku4" else _independent_arith_ok
    independent = [check(ex.prompt, o.outputs[0].text) for ex, o in zip(examples, outs)]
    assert row.accuracy == sum(independent) / len(independent)
    assert row.num == 24 and row.nfe > 0
    if k == 4:                   # committing 4 tokens per step visibly fails on both tasks
        assert row.accuracy < 0.9


def test_eval_cli_writes_the_documented_json(tmp_path, capsys):
    path = tmp_path / "eval.json"
    code = main(["eval", "--model", "cover-tiny", "--task", "word", "--decoding",
                 "low_confidence,cover", "--num", "8", "--json", str(path), "--no-tqdm"])
    assert code == 0
    rows = json.loads(path.read_text())
    assert [r["decoding"] for r in rows] == ["low_confidence", "cover"]
    for r in rows:
        assert {"task", "decoding", "num", "accuracy", "nfe", "nfe_per_token", "tokens_per_step",
                "tokens_per_s", "remasks", "flip_flops"} <= set(r)
        assert r["task"] == "word" and r["num"] == 8
    assert "| word | cover |" in capsys.readouterr().out


def test_eval_cli_rejects_unknown_names(capsys):
    assert main(["eval", "--task", "nope", "--num", "1"]) == 2
    assert "valid tasks" in capsys.readouterr().err
    assert main(["eval", "--task", "word", "--decoding", "greedy", "--num", "1"]) == 2
    assert "valid" in capsys.readouterr().err


def test_cover_tiny_loads_without_network_and_generates():
    llm = LLM("cover-tiny")
    (out,) = llm.chat([{"role": "user", "content": "Sudoku:\n1423\n32_1\n_13_\n_3__"}],
                      use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text


def test_eval_runs_on_a_block_causal_model(tmp_path):
    """eval's tasks are cover-tiny's (its tokenizer): a random-weight SDAR model with that
    vocabulary and tokenizer runs them (accuracy ~0), with and without per-block KV reuse."""
    import shutil
    from pathlib import Path

    from golden_cases import GOLDEN

    import cover_vllm

    assets = Path(cover_vllm.__file__).parent / "assets" / "cover-tiny"
    config = json.loads((GOLDEN / "sdar" / "model" / "config.json").read_text())
    tiny = json.loads((assets / "config.json").read_text())
    config.update({k: tiny[k] for k in ("vocab_size", "mask_token_id", "eos_token_id",
                                        "pad_token_id")}, bos_token_id=tiny["eos_token_id"])
    shape, ckpt = tmp_path / "shape", tmp_path / "ckpt"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(config))
    assert main(["make-checkpoint", "--shape", str(shape), "--dtype", "float32", "--out",
                 str(ckpt)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(assets / name, ckpt / name)
    path = tmp_path / "eval.json"
    assert main(["eval", "--model", str(ckpt), "--task", "word", "--decoding", "low_confidence",
                 "--kv-cache", "none,dual", "--num", "2", "--threads", "1", "--no-tqdm",
                 "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["kv_cache"] for r in rows] == ["none", "dual"]
    assert all(r["num"] == 2 and 0 <= r["accuracy"] <= 1 and r["nfe"] > 0 for r in rows)
    assert rows[1]["flops_per_token"] < rows[0]["flops_per_token"]


@pytest.mark.parametrize("lost,gained", [(0, 0), (5, 5), (0, 10), (3, 9), (57, 41), (41, 57)])
def test_sign_test_is_the_exact_binomial_tail(lost, gained):
    """McNemar's exact test against torch's binomial distribution, computed independently."""
    import torch

    n = lost + gained
    if n == 0:
        assert sign_test(lost, gained) == 1.0
        return
    tail = torch.distributions.Binomial(n, torch.tensor(0.5, dtype=torch.float64)).log_prob(
        torch.arange(min(lost, gained) + 1, dtype=torch.float64)).exp().sum().item()
    assert sign_test(lost, gained) == pytest.approx(min(1.0, 2 * tail), rel=1e-9)


def test_compare_counts_the_problems_lost_and_gained():
    row = EvalRow(task="arith", decoding="entropy", k=1, kv_cache="none", cache_refresh="-",
                  num=6, seed=None, accuracy=3 / 6, nfe=1, nfe_per_token=1, tokens_per_step=1,
                  tokens_per_s=1, remasks=0, flip_flops=0, replaces=0, keeps=0, refreshes=1,
                  flops_per_token=1, seconds=1, solved="110010")
    base = dict(asdict(row), accuracy=4 / 6, solved="101110")
    (paired,) = compare([row], {row_key(base): base})
    assert (paired.lost, paired.gained, paired.baseline) == (2, 1, 4 / 6)
    assert paired.p_value == 1.0
    with pytest.raises(ValueError, match="num=6, seed=3; this run num=6, seed=None"):
        compare([row], {row_key(base): dict(base, seed=3)})


def test_eval_cli_pairs_a_run_with_its_baseline(tmp_path, capsys):
    """The same problems twice, in fp32 and in bf16: each row's problems lost and gained, and
    a baseline from another draw, or one written without `solved`, is refused before any work."""
    base = tmp_path / "fp32.json"
    common = ["eval", "--model", "cover-tiny", "--task", "word", "--decoding", "low_confidence",
              "--num", "8", "--threads", "1", "--no-tqdm"]
    assert main(common + ["--dtype", "float32", "--json", str(base)]) == 0
    (row,) = json.loads(base.read_text())
    assert row["seed"] is None and len(row["solved"]) == 8
    assert row["solved"].count("1") == round(8 * row["accuracy"])
    capsys.readouterr()
    assert main(common + ["--dtype", "bfloat16", "--baseline", str(base)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("| word | low_confidence | 1 | none")
                and x.count("|") == 12)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5] == f"{row['accuracy']:.1%}"
    lost, gained = int(cells[8]), int(cells[9])
    assert float(cells[7]) == pytest.approx(100 * (gained - lost) / 8, abs=0.051)
    assert float(cells[10]) == pytest.approx(sign_test(lost, gained), rel=1e-2)
    assert main(common + ["--seed", "1", "--baseline", str(base)]) == 2
    assert "ran num=8, seed=None; this run num=8, seed=1" in capsys.readouterr().err
    base.write_text(json.dumps([{k: v for k, v in row.items() if k != "solved"}]))
    assert main(common + ["--baseline", str(base)]) == 2
    assert "lacks ['solved']" in capsys.readouterr().err
