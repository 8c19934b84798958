"""The building blocks a model family is composed of, and the kernels under them (after vLLM's
model_executor/layers): the plain types layers and families share (base.py: AttentionFn,
ModelDims, ParallelPlan, Slice), the Llama-style norm, rotary, fused-projection, attention and
decoder blocks (common.py), the Gemma 4 blocks (gemma4.py, gemma4_shape.py), MoE experts stored
stacked (stacked_experts.py) and run stacked (expert_stack.py), and the quantized formats and
matmuls (quantization/).

Not here: a family's own wiring (models/<family>.py), checkpoint reading and loading
(models/loader.py, weights.py), quantizing and loading a whole model (models/quantization.py).
Nothing in this package imports cover_vllm.models."""
