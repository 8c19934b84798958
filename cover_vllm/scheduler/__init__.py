"""Scheduling: requests and their canvases, KV page admission, per-step work items."""
