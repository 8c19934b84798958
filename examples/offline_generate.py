"""Offline generation with the vLLM-style API: one LLM, several strategies in one batch.

    python examples/offline_generate.py            # uses the shipped cover-tiny model
"""

from cover_vllm import LLM, SamplingParams

llm = LLM(model="cover-tiny", decoding="cover", kv_cache="none")
question = [{"role": "user", "content": "384+250="}]        # cover-tiny's worked addition task
params = [
    SamplingParams(max_tokens=32, decoding="cover"),                       # the default
    SamplingParams(max_tokens=32, decoding="threshold", decoding_params={"threshold": 0.9}),
    SamplingParams(max_tokens=32, decoding="low_confidence", steps=32),    # 1 token / step
]
for p in params:
    (out,) = llm.chat(question, p, use_tqdm=False)
    m = out.metrics
    print(f"{p.decoding:>15}: {out.outputs[0].text!r}  nfe={m.nfe} tokens/step="
          f"{m.tokens_per_step:.2f} seeds={m.seeds_verified} remasks={m.remasks}")
