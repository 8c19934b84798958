"""Usage: python scripts/interleaved_reference.py DTYPE BATCH ROUNDS MODES (e.g. bfloat16 1 3 dual,prefix,none).

Engine (after / before worker/logit_rows.py + keys_are_window) and the reference loop of the
same cache mode, alternating in one process, llada-50m, 64-token prompt + 128 tokens, blocks of
32, 1 token/step, one thread; medians of N rounds. bs>1: the engine serves B prompts at once,
the reference decodes one (its rate is per request)."""
import random, statistics, sys, time
from cover_vllm.attention import layout
from cover_vllm.llm import LLM
from cover_vllm.reference_cache_decode import DecodeSchedule, reference_cache_generate
from cover_vllm.reference_decode import reference_generate
from cover_vllm.sampling_params import SamplingParams
dt, bs, n, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
keys_window = layout._keys_are_window
llm = LLM("llada-50m", decoding="low_confidence", max_num_seqs=bs, load_format="dummy",
          dtype=dt, seed=0, num_threads=1)
runner, model = llm.engine.executor.runner, llm.engine.executor.model
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(16382) for _ in range(64)]} for _ in range(bs)]
sched = DecodeSchedule(128, 32, 128, model.spec.mask_token_id)
def toggle(on):
    runner.masked_logits = on
    layout._keys_are_window = keys_window if on else (lambda *a: False)
for kv in modes:
    sp = SamplingParams(max_tokens=128, block_length=32, ignore_eos=True, kv_cache=kv,
                        cache_refresh=None if kv == "none" else "block")
    ids = prompts[0]["prompt_token_ids"]
    ref = ((lambda: reference_generate(model, ids, 128, 32, 128, sched.mask_id)) if kv == "none"
           else (lambda: reference_cache_generate(model, ids, sched, kv)[0]))
    def engine(on):
        toggle(on)
        llm.reset_prefix_cache()        # no prompt block reused from the last run
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    runs = {"after": lambda: engine(True), "before": lambda: engine(False), "reference": ref}
    for fn in runs.values():
        fn()                                                        # warm-up
    rate = {k: [] for k in runs}
    out = {}
    for _ in range(n):
        for name, fn in runs.items():
            t = time.perf_counter()
            out[name] = fn()
            rate[name].append(128 * (bs if name != "reference" else 1) / (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in rate.items()}
    same = out["after"] == out["before"] and (bs > 1 or out["after"][0] == out["reference"])
    print(f"{dt} {kv:6} bs={bs:<2} tok/s: after {med['after']:6.1f}  before {med['before']:6.1f}  "
          f"reference {med['reference']:6.1f}  | after/ref x{med['after'] / med['reference']:.2f}"
          f"  before/ref x{med['before'] / med['reference']:.2f}  after/before "
          f"x{med['after'] / med['before']:.3f}  tokens equal: {same}  "
          f"runs {[round(r, 1) for r in rate['after']]} {[round(r, 1) for r in rate['before']]} "
          f"{[round(r, 1) for r in rate['reference']]}", flush=True)
