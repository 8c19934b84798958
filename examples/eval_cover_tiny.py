"""Held-out accuracy of cover-tiny vs tokens committed per step, with the reference decoder.

For each task and each k in --k, every held-out problem is decoded by
`cover_vllm.reference_decode.reference_generate` (low-confidence remasking, temperature 0) with
gen_length = task.max_tokens, block_length = task.block_length and steps = ceil(gen_length / k), then
checked by the task's exact verifier. Prints a markdown table.

    python examples/eval_cover_tiny.py --model cover-tiny --n 300 --k 1,2,4,8
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer

from cover_vllm.models import load_model, resolve_model_dir
from cover_vllm.reference_decode import reference_generate
from cover_vllm.tasks import chat_prompt_ids, get_task, list_tasks


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cover-tiny", help="built-in name or checkpoint dir")
    p.add_argument("--tasks", default=",".join(list_tasks()))
    p.add_argument("--n", type=int, default=300, help="held-out problems per task")
    p.add_argument("--k", default="1,2,4,8", help="tokens per step to evaluate")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    mask_id = model.spec.mask_token_id
    ks = [int(k) for k in args.k.split(",")]
    print(f"| task | problems | " + " | ".join(f"{k} tok/step" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for name in args.tasks.split(","):
        task = get_task(name)
        examples = task.eval_split(args.n)
        prompts = [chat_prompt_ids(tokenizer, ex.prompt) for ex in examples]
        cells, start = [], time.time()
        for k in ks:
            steps = -(-task.max_tokens // k)       # LLaDA spreads a remainder over the steps
            solved = 0
            for ex, ids in zip(examples, prompts):
                out = reference_generate(model, ids, task.max_tokens, task.block_length, steps,
                                         mask_id)
                solved += task.check(ex.prompt, tokenizer.decode(out, skip_special_tokens=True))
            cells.append(f"{100 * solved / len(examples):.1f} % ({steps} fwd)")
        print(f"| {name} | {len(examples)} | " + " | ".join(cells) + f" |  <!-- "
              f"{time.time() - start:.0f}s -->", flush=True)


if __name__ == "__main__":
    main()
