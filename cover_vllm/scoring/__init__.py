"""Likelihood scoring: the Monte-Carlo log-likelihood of a continuation given a context, run by
the engine as forward-only work beside generation (docs/architecture.md, "Likelihood scoring").

Here, below the scheduler: params.py (LoglikelihoodParams, LoglikelihoodOutput), estimator.py
(the official masking draws), items.py (what crosses to the runner), prompts.py (text pairs and
validation), reference.py (the slow official loop, for tests and the benchmark). Elsewhere:
scheduler/score_request.py (one request's state), scheduler/score_queue.py (admission, pages,
shared context blocks), worker/scoring.py (the runner's reduction on the device).
"""

from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams, ScoreMetrics

__all__ = ["LoglikelihoodOutput", "LoglikelihoodParams", "ScoreMetrics"]
