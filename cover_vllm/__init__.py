"""cover_vllm: an inference engine for masked diffusion LLMs with COVER decoding."""

from cover_vllm.llm import LLM
from cover_vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cover_vllm.sampling_params import SamplingParams, StructuredOutputsParams
from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "LoglikelihoodOutput", "LoglikelihoodParams",
           "RequestMetrics", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
