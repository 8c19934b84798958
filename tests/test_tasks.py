"""Tasks (generators, exact verifiers, held-out splits), the shipped cover-tiny checkpoint and
tokenizer, and the dense reference decoding loop."""

from __future__ import annotations

import random
import time

import pytest
import torch

from cover_vllm.models.builtin import BUILTIN_DIRS
from cover_vllm.reference_decode import num_transfer_tokens, reference_generate
from cover_vllm.tasks import chat_prompt_ids, get_task, list_tasks
from cover_vllm.tasks.arith import column_steps
from cover_vllm.tasks.sudoku import all_solutions, count_solutions, format_puzzle, parse_puzzle
from cover_vllm.tasks.word import solve

TINY_DIR = BUILTIN_DIRS["cover-tiny"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_DIR))


def test_registry_lists_and_rejects_names():
    assert {"sudoku4", "arith", "word"} <= set(list_tasks())
    for name in list_tasks():
        assert get_task(name).name == name
    with pytest.raises(ValueError, match="sudoku4"):
        get_task("sudoku9")


@pytest.mark.parametrize("name", ["sudoku4", "arith", "word"])
def test_reference_answers_pass_and_splits_are_fixed(name):
    task = get_task(name)
    split = task.eval_split(200)
    assert split == get_task(name).eval_split(200)
    assert split[:50] == task.eval_split(50)
    assert len({ex.prompt for ex in split}) > 150
    assert all(task.check(ex.prompt, ex.answer) for ex in split)
    assert all(task.check(ex.prompt, ex.answer + "<|endoftext|><|endoftext|>") for ex in split)
    rng = random.Random(1)
    assert all(task.check(ex.prompt, ex.answer) for ex in (task.sample(rng) for _ in range(200)))


def test_sudoku_accepts_every_valid_solution_and_rejects_invalid_ones():
    task = get_task("sudoku4")
    assert len(all_solutions()) == 288
    multi = next(ex for ex in task.eval_split(100)
                 if count_solutions(parse_puzzle(ex.prompt)) > 1)
    puzzle = parse_puzzle(multi.prompt)
    fits = [g for g in all_solutions() if all(p in (0, v) for p, v in zip(puzzle, g))]
    assert len(fits) > 1
    for grid in fits:
        text = "\n".join("".join(map(str, grid[r * 4:(r + 1) * 4])) for r in range(4))
        assert task.check(multi.prompt, text)
    solution = "1234\n3412\n2143\n4321"
    prompt = format_puzzle((1, 2, 0, 0) + (0,) * 12)
    assert task.check(prompt, solution)
    assert not task.check(prompt, "1234\n3412\n2143\n4312")        # row/column clash
    assert not task.check(format_puzzle((2,) + (0,) * 15), solution)  # contradicts a given
    assert not task.check(prompt, "1234\n3412\n2143")                 # malformed
    assert not task.check("Sudoku:\n12", solution)                    # malformed prompt


def test_arith_verifier_checks_every_worked_step_in_either_digit_order():
    arith = get_task("arith")
    assert column_steps(347, 158, 3) == ["7+8+0=15", "4+5+1=10", "3+1+1=05", "=505"]
    orders = {tuple(column_steps(347, 158, 3, random.Random(seed))) for seed in range(40)}
    assert len(orders) == 8                          # each line's two digits in either order
    for lines in orders:
        assert arith.check("347+158=", "\n".join(lines))
    assert arith.check("347+158=", "8+7+0=15\n4+5+1=10\n1+3+1=05\n=505<|endoftext|>")
    assert not arith.check("347+158=", "7+8+0=15\n4+5+1=10\n3+1+1=05\n=504")  # wrong sum
    assert not arith.check("347+158=", "7+7+0=15\n4+5+1=10\n3+1+1=05\n=505")  # mixed orders
    assert not arith.check("347+158=", "7+8+0=15\n4+5+0=09\n3+1+1=05\n=505")  # carry dropped
    assert not arith.check("347+158=", "7+8+0=15\n4+5+1=10\n3+1+1=15\n=505")  # bad column
    assert not arith.check("347+158=", "=505")       # the steps are part of the answer
    assert not arith.check("347+158=", "505")
    assert not arith.check("347+158", "7+8+0=15\n4+5+1=10\n3+1+1=05\n=505")


def test_word_verifier_checks_the_final_number():
    word = get_task("word")
    prompt = ("Mia has 3 pens. She buys 5 more, then she gives 2 to Leo. "
              "How many pens does Mia have now?")
    assert solve(prompt) == 6
    assert word.check(prompt, "3+5=8. 8-2=6. Mia has 6 pens.")
    assert not word.check(prompt, "3+5=8. 8-2=5. Mia has 5 pens.")
    assert not word.check("What is love?", "42")


def test_schedule_and_argument_checks():
    assert num_transfer_tokens(10, 4) == [3, 3, 2, 2]
    assert num_transfer_tokens(24, 24) == [1] * 24
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError):
        reference_generate(model, [1], gen_length=24, block_length=32, steps=24, mask_id=0)
    with pytest.raises(ValueError):
        reference_generate(model, [1], gen_length=32, block_length=16, steps=3, mask_id=0)


@pytest.mark.parametrize("name", ["sudoku4", "arith", "word"])
def test_prompts_round_trip_with_the_shipped_tokenizer(tokenizer, name):
    task = get_task(name)
    user, assistant = (tokenizer.convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>"))
    for ex in task.eval_split(50):
        ids = chat_prompt_ids(tokenizer, ex.prompt)
        assert ids[0] == user and ids[-1] == assistant
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids[1:-1]) == ex.prompt
        answer = tokenizer.encode(ex.answer, add_special_tokens=False)
        assert tokenizer.decode(answer) == ex.answer
        assert len(answer) + 1 <= task.max_tokens


def test_shipped_checkpoint_loads_fast_and_solves_sudoku(tokenizer):
    from cover_vllm.models import load_model

    start = time.process_time()            # this process's CPU time: not how busy the machine is
    model = load_model("cover-tiny")
    assert time.process_time() - start < 1.0
    spec = model.spec
    assert spec.mask_token_id == tokenizer.mask_token_id
    assert spec.eos_token_ids == (tokenizer.eos_token_id,)
    task = get_task("sudoku4")
    solved = 0
    for ex in task.eval_split(6):
        out = reference_generate(model, chat_prompt_ids(tokenizer, ex.prompt), task.max_tokens,
                                 task.block_length, steps=task.max_tokens,
                                 mask_id=spec.mask_token_id)
        assert spec.mask_token_id not in out and out[-1] == tokenizer.eos_token_id
        solved += task.check(ex.prompt, tokenizer.decode(out, skip_special_tokens=True))
    assert solved >= 5
