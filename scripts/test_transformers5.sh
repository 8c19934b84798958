#!/usr/bin/env bash
# The default suite under transformers 5 (what a current CUDA image carries; pyproject allows
# 4.46 .. 5.x, scripts/test.sh runs 4.x): installs into .venv-tf5 through scripts/install.sh,
# then runs pytest (extra arguments go to pytest). TRANSFORMERS picks another release, e.g.
# TRANSFORMERS=transformers==5.17.0; the default is the newest 5.x tested here.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-tf5 TRANSFORMERS=${TRANSFORMERS:-transformers==5.24.0} bash scripts/install.sh || exit 1
.venv-tf5/bin/python -c "import transformers, huggingface_hub; print('transformers',
    transformers.__version__, 'huggingface_hub', huggingface_hub.__version__)"
.venv-tf5/bin/python -m pytest -q "$@"
code=$?
if [ "$code" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$code"
