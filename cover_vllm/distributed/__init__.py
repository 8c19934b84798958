"""Tensor parallelism: the process group between ranks (comm) and the model-sharding transform."""
