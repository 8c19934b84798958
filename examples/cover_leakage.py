"""How much of a committed token leaks into COVER's single-pass leave-one-out prediction.

COVER checks a committed token y_s by masking s in the input while every other row keeps seeing
s's cached (visible) K/V, and correcting row s's own column (ALGORITHMS.md §1.4). The direct path
from s to its predictor row is closed, but the other rows carry y_s into row s from the second
layer on ("indirect leakage"). This script measures that on real final canvases: for every
generated position s of every canvas it compares

* cover: the single-pass view above, computed by brute force (dense attention, the override and
  row s's own fresh K/V written out explicitly; no engine code involved);
* true:  s masked for every row (a full re-forward: what a ReMask and redraft sees).

A canvas comes from a decoder run on a task's held-out split (default: low_confidence at 4
tokens/step, which makes many errors). Reported per task: how often each view's argmax
disagrees with the committed token, on all canvases and on those the verifier rejects, and the
recall of the cover check (of the tokens the true view would change, the share cover flags too).

    PYTHONPATH=. python examples/cover_leakage.py --tasks sudoku4,arith --num 100
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cover_vllm import LLM, SamplingParams
from cover_vllm.tasks import chat_prompt_ids, get_task


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, d], k/v [T, H, d] -> [T, H, d]; bidirectional, no padding."""
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1)).transpose(0, 1)


class Views:
    """The visible forward (recording K/V), COVER's single-pass view and the true masked view."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.mask_id = model.spec.mask_token_id

    def _run(self, ids: torch.Tensor, attn) -> torch.Tensor:
        hidden = self.model.forward_tokens(self.model.embed(ids), torch.arange(ids.numel()), attn)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def visible_kv(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kv = []

        def attn(layer, q, k, v):
            kv.append((k, v))
            return dense_attention(q, k, v)

        self._run(ids, attn)
        return kv

    @torch.inference_mode()
    def cover(self, ids: torch.Tensor, s: int, kv) -> torch.Tensor:
        """Logits of row s with s masked in the input, other rows reading s's visible K/V."""
        masked = ids.clone()
        masked[s] = self.mask_id

        def attn(layer, q, k, v):
            k_ctx, v_ctx = k.clone(), v.clone()
            k_ctx[s], v_ctx[s] = kv[layer][0][s], kv[layer][1][s]
            o = dense_attention(q, k_ctx, v_ctx)
            o[s] = dense_attention(q[s:s + 1], k, v)[0]     # row s: its own masked K/V
            return o

        return self._run(masked, attn)[s]

    @torch.inference_mode()
    def true(self, ids: torch.Tensor, s: int) -> torch.Tensor:
        masked = ids.clone()
        masked[s] = self.mask_id
        return self._run(masked, lambda layer, q, k, v: dense_attention(q, k, v))[s]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cover-tiny")
    p.add_argument("--tasks", default="sudoku4,arith,word")
    p.add_argument("--num", type=int, default=100)
    p.add_argument("--decoding", default="low_confidence")
    p.add_argument("--tokens-per-step", type=int, default=4)
    args = p.parse_args()
    llm = LLM(args.model, kv_cache="none")
    model = llm.engine.executor.model
    if model.spec.logit_shift:
        raise SystemExit("this script handles unshifted (LLaDA-style) models only")
    views = Views(model)
    print("| task | canvases (failed) | tokens | cover ≠ token | true ≠ token | "
          "same argmax | recall | cover ≠ token, failed | true ≠ token, failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.tasks.split(","):
        task = get_task(name)
        examples = task.eval_split(args.num)
        prompts = [{"prompt_token_ids": chat_prompt_ids(llm.tokenizer, ex.prompt)}
                   for ex in examples]
        sp = SamplingParams(max_tokens=task.max_tokens, block_length=task.block_length,
                            steps=task.max_tokens // args.tokens_per_step,
                            decoding=args.decoding, ignore_eos=True)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        counts = torch.zeros(2, 5)            # rows: all, failed; cols: n, cover≠, true≠, same, both≠
        failed_canvases = 0
        for ex, prompt, out in zip(examples, prompts, outs):
            ok = task.check(ex.prompt, out.outputs[0].text)
            failed_canvases += not ok
            gen = list(out.outputs[0].token_ids)
            ids = torch.tensor(prompt["prompt_token_ids"] + gen)
            kv = views.visible_kv(ids)
            for s in range(len(prompt["prompt_token_ids"]), ids.numel()):
                y = int(ids[s])
                c = int(views.cover(ids, s, kv).argmax())
                t = int(views.true(ids, s).argmax())
                row = torch.tensor([1.0, c != y, t != y, c == t, (c != y) and (t != y)])
                counts[0] += row
                if not ok:
                    counts[1] += row
        n, cov, tru, same, both = counts[0].tolist()
        nf, covf, truf = counts[1, 0].item(), counts[1, 1].item(), counts[1, 2].item()
        pct = lambda a, b: f"{100 * a / b:.1f} %" if b else "-"  # noqa: E731
        print(f"| {name} | {len(outs)} ({failed_canvases}) | {int(n)} | {pct(cov, n)} | "
              f"{pct(tru, n)} | {pct(same, n)} | {pct(both, tru)} | {pct(covf, nf)} | "
              f"{pct(truf, nf)} |", flush=True)


if __name__ == "__main__":
    main()
