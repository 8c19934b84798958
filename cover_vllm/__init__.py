"""cover_vllm: an inference engine for masked diffusion LLMs with COVER decoding."""

from cover_vllm.inputs import TextPrompt, TokensPrompt
from cover_vllm.llm import LLM
from cover_vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cover_vllm.sampling_params import SamplingParams, StructuredOutputsParams
from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "LoglikelihoodOutput", "LoglikelihoodParams",
           "RequestMetrics", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "TextPrompt", "TokensPrompt"]                    # vLLM exports these two at the top too
__version__ = "0.1.0"
