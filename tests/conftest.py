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


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M's GGUF read and dequantized once per test process: ``(config, weights,
    fields, tokenizer)``. Shared by every module that runs the real model; tests must not modify
    the weight tensors in place (build a model from them, or copy)."""
    from companion import llama, pretrained

    config, weights, fields = llama.read_gguf(pretrained.smollm2_gguf_path())
    return config, weights, fields, llama.gguf_tokenizer(fields)


@pytest.fixture(scope="session")
def smollm2_weights64(smollm2_gguf):
    """Float64 copies of SmolLM2's weights, made once per test process: the reference models of
    the rounding bounds are built from them."""
    return {k: v.double() for k, v in smollm2_gguf[1].items()}


#: Test modules that do no floating-point arithmetic whose result could depend on the numeric
#: configuration: prose and page rules, the bibliography, the pins, the import graph, command
#: help texts, and fetching and caching files. ``make test-portable`` sets
#: ``COMPANION_PORTABILITY_RUN=1`` when it re-runs the unit tests under another configuration of
#: the portability matrix; their tests are then deselected, since the default
#: configuration has just run them. (``tests/test_portability.py`` checks the list.)
CONFIG_INDEPENDENT = (
    "test_bibliography.py",
    "test_cli_help.py",
    "test_layering.py",
    "test_pins.py",
    "test_presentation.py",
    "test_pretrained.py",
    "test_prose.py",
)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("COMPANION_PORTABILITY_RUN") != "1":
        return
    left_out = [item for item in items if item.path.name in CONFIG_INDEPENDENT]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.path.name not in CONFIG_INDEPENDENT]
