"""Which problems W8A8 flips against fp32: cover-tiny eval rows per problem, with kinds of
projection kept int8 weight-only or the down projections smoothed (docs/benchmarks.md "W8A8").

    .venv/bin/python scripts/w8a8_flips.py --task arith --decoding entropy \\
        [--keep down,head] [--smoothquant proxy|calibrated --alpha 0.5] [--fp32-embedding] \\
        [--no-rotation] [--seed 1] [--rotation-seeds 0,1,2]

Runs fp32 first, then w8a8 (the variant) on the same problems (the held-out split, or `--num`
fresh draws from `--seed`), the way `cover-vllm eval` runs a row (`eval.evaluate_one`, kv_cache
none, fp32 activations, one thread), and prints each decoder's accuracy and the problems it
lost and gained against fp32. `--keep` roles: qkv, out, gate_up, down, head
(w8a8_outliers.roles); those groups get int8's weight-only kernel instead (same codes).
`--no-rotation`: w8a8 without its input rotation (`QuantConfig(rotation=False)`), as it
shipped first. `--rotation-seeds`: w8a8 once per seed of the rotation's random signs (0: the
shipped signs; every seed gives an equally valid R), then each decoder's spread of the
difference to fp32 over the seeds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from cover_vllm import LLM
from cover_vllm.eval import evaluate_one, lost_gained, problems, sign_test
from cover_vllm.layers.common import projection_groups
from cover_vllm.layers.quantization import format as quant_format
from cover_vllm.layers.quantization.format import QuantConfig
from cover_vllm.strategies import strategy_class
from cover_vllm.tasks import get_task
from cover_vllm.worker import worker
from w8a8_outliers import down_inputs, roles, write_smoothed


def keep_weight_only(kinds: set[str]) -> None:
    """Make every Worker's quantize_model leave the `kinds` groups weight-only int8."""
    quantize = worker.quantize_model

    def patched(model, config):
        count = quantize(model, config)
        role, int8 = roles(model), QuantConfig("int8")
        for group in projection_groups(model):
            if role.get(id(group)) in kinds and group.quant is not None:
                group.quant.config = int8
                for lin in group.linears:
                    lin.quant_config = int8
        return count
    worker.quantize_model = patched


def solved(model: str, quantization, task, examples, decodings: list[str]) -> dict[str, str]:
    """Each decoder's `solved` (eval.EvalRow: "1"/"0" a problem) on `examples`."""
    llm = LLM(model, quantization=quantization, num_threads=1, dtype="float32",
              kv_cache="none", decoding=decodings[0])
    out = {}
    for name in decodings:
        llm.reset_prefix_cache()
        k = 1 if strategy_class(name).fixed_schedule else None
        row, _ = evaluate_one(llm, task, examples, name, k, None, False)
        out[name] = row.solved
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="arith")
    p.add_argument("--decoding", default="entropy,maskgit_plus,topk_margin")
    p.add_argument("--num", type=int, default=1000)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", default="", help="roles kept weight-only, comma-separated")
    p.add_argument("--smoothquant", choices=("proxy", "calibrated"), default=None)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--fp32-embedding", action="store_true", help="keep the embedding table "
                   "in the model dtype (QuantConfig(embedding=False))")
    p.add_argument("--no-rotation", action="store_true", help="w8a8 without the input "
                   "rotation (QuantConfig(rotation=False))")
    p.add_argument("--rotation-seeds", default="0", help="seeds of the rotation's signs, "
                   "comma-separated: one w8a8 run each (0: the shipped signs)")
    args = p.parse_args()
    torch.set_num_threads(1)
    task, decodings = get_task(args.task), args.decoding.split(",")
    examples = problems(task, args.num, args.seed)
    want = solved("cover-tiny", None, task, examples, decodings)
    if args.keep:
        keep_weight_only(set(args.keep.split(",")))
    quantization = QuantConfig("w8a8", embedding=False if args.fp32_embedding else None,
                               rotation=False if args.no_rotation else None)
    model = "cover-tiny"
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoothquant:            # the smoothed checkpoint does not depend on the signs
            path, seen = down_inputs("cover-tiny")
            write_smoothed(path, seen, args.alpha, args.smoothquant == "proxy", tmp)
            model = tmp
        deltas: dict[str, list[float]] = {name: [] for name in decodings}
        for seed in map(int, args.rotation_seeds.split(",")):
            quant_format.ROTATION_SEED = seed
            got = solved(model, quantization, task, examples, decodings)
            for name in decodings:
                lost, gained = lost_gained(want[name], got[name])
                fp32, w8a8 = (100 * v[name].count("1") / len(examples) for v in (want, got))
                deltas[name].append(w8a8 - fp32)
                print(f"{args.task} {name} rotation seed {seed}: fp32 {fp32:.1f} %, w8a8 "
                      f"{w8a8:.1f} % ({w8a8 - fp32:+.1f}); lost {lost}, gained {gained} "
                      f"(p {sign_test(lost, gained):.2g})", flush=True)
    if len(deltas[decodings[0]]) > 1:
        for name, d in deltas.items():
            print(f"{args.task} {name} over {len(d)} rotation seeds: "
                  f"mean {statistics.mean(d):+.2f}, sd {statistics.stdev(d):.2f}, "
                  f"range {min(d):+.1f} .. {max(d):+.1f}, "
                  f"within 1 point in {sum(abs(x) <= 1 for x in d)}")


if __name__ == "__main__":
    main()
