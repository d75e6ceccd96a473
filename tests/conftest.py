import os

from hypothesis import HealthCheck, settings

import tritonllm  # noqa: F401  (sets TRITON_INTERPRET before any kernel is decorated)

# `ci`: few derandomized examples so the interpreter stays fast; `gpu`: many fresh ones for compiled runs.
settings.register_profile(
    "ci",
    max_examples=8,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu",
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
