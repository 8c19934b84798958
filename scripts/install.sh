#!/usr/bin/env bash
# Creates .venv (once) and installs cover_vllm with its test, bench, serve, ray and eval extras into it
# (ray: about 250 MB and 35 s to install; tests marked `ray` skip when it is missing).
# torch is pinned to 2.13.0: the CPU wheel this machine has on disk (a plain `torch` pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,bench,serve,ray,eval]"
