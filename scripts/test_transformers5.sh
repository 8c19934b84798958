#!/usr/bin/env bash
# The default suite under transformers 5 (what a current CUDA image carries; pyproject allows
# 4.46 .. 5.x, scripts/test.sh runs 4.x): scripts/test.sh with its own venv, .venv-tf5 (extra
# arguments go to pytest). TRANSFORMERS picks another release, e.g.
# TRANSFORMERS=transformers==5.17.0; the default is the newest 5.x tested here.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=.venv-tf5 TRANSFORMERS=${TRANSFORMERS:-transformers==5.24.0}
exec bash scripts/test.sh "$@"
