"""cover_vllm: an inference engine for masked diffusion LLMs with COVER decoding."""

from cover_vllm.llm import LLM
from cover_vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cover_vllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
