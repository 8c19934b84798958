#!/usr/bin/env bash
# The test command: installs what it needs, then runs pytest (extra arguments go to pytest).
# pytest's exit code 5 ("no tests collected") is treated as a failure. VENV and TRANSFORMERS
# go to scripts/install.sh (scripts/test_transformers5.sh sets them).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
PY="${VENV:-.venv}/bin/python"
"$PY" -c "import torch, transformers as t, huggingface_hub as h; print('torch', torch.__version__,
    '| transformers', t.__version__, '| huggingface_hub', h.__version__)"
"$PY" -m pytest -q "$@"
code=$?
if [ "$code" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$code"
