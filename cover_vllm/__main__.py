"""`python -m cover_vllm` is the `cover-vllm` command."""

import sys

from cover_vllm.entrypoints.cli import main

sys.exit(main())
