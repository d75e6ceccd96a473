"""`python -m tritonllm ...` is the `tritonllm` command."""

import sys

from tritonllm.entrypoints.cli import main

sys.exit(main())
