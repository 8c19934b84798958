#!/usr/bin/env bash
# The test command: installs what it needs, then runs pytest (extra arguments go to pytest).
# pytest's exit code 5 ("no tests collected") is treated as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
.venv/bin/python -m pytest -q "$@"
code=$?
if [ "$code" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$code"
