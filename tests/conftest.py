import os

import torch

# On a CPU-only machine the Triton kernels run under the interpreter. This must be set before
# any @triton.jit decorator runs, so it happens here, before the test modules import kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
