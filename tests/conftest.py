import logging
import os

import torch

# On a CPU-only machine the Triton kernels run under the interpreter. This must be set before
# any @triton.jit decorator runs, so it happens here, before the test modules import kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402  (after the TRITON_INTERPRET switch above, on purpose)
from torch._dynamo.utils import counters  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts with empty dynamo caches and ssm counters, so the rewrites it counts and
    the recompiles it sees are its own."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def quiet_ssm_log():
    """Only errors from the ``ssm_compile`` logger: a refused rewrite or a fallback logs its
    reason (with the whole failing node); tests that use this read the reasons from ``explain``
    or the records instead."""
    logger = logging.getLogger("ssm_compile")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)
