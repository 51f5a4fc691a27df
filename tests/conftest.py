"""Test configuration shared by the whole suite.

``TRITON_INTERPRET=1`` must be set before any module that defines ``@triton.jit`` kernels is
imported, so the Triton kernels run on CPU tensors through Triton's interpreter (the machines
that run CI have no GPU). Set it here, at the very top, before anything imports companion.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests: no per-example deadline (shared, noisy machines), a modest example count.
settings.register_profile(
    "companion",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "companion"))

torch.set_num_threads(1)  # tests run in parallel under pytest-xdist
