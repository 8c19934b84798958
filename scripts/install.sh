#!/usr/bin/env bash
# Creates .venv (once) and installs cover_vllm with its test, bench, serve, ray and eval extras into it
# (ray: about 250 MB and 35 s to install; tests marked `ray` skip when it is missing).
# torch is pinned to 2.13.0: the CPU wheel this machine has on disk (a plain `torch` pulls CUDA).
# pyproject allows torch >= 2.6 and transformers 4.46 .. 5.x; CI's default environment keeps
# transformers 4.x (TRANSFORMERS), and scripts/test_transformers5.sh runs the suite under 5 in
# its own VENV through this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TRANSFORMERS=${TRANSFORMERS:-transformers<5}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,bench,serve,ray,eval]" \
    "$TRANSFORMERS"
