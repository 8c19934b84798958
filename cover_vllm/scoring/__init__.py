"""Likelihood scoring: the Monte-Carlo log-likelihood of a continuation given a context, run by
the engine as forward-only work beside generation (docs/architecture.md, "Likelihood scoring").

params.py (LoglikelihoodParams, LoglikelihoodOutput), estimator.py (the official masking draws),
items.py (what crosses to the runner), request.py (one request's state), queue.py (admission,
pages, shared context blocks), prompts.py (text pairs and validation), reference.py (the slow
official loop, for tests and the benchmark). The runner's side is worker/scoring.py.
"""

from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams, ScoreMetrics

__all__ = ["LoglikelihoodOutput", "LoglikelihoodParams", "ScoreMetrics"]
