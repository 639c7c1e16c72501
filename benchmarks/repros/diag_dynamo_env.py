# Why the device's torch 2.11 recompiles a dynamic batch that the same torch 2.11 on a CPU-only
# host does not (run 40): the environment, dynamo's non-default config, and CPU autocast's matmul.
import os
import platform

import torch
import torch._dynamo.config as dc

print(platform.python_version(), torch.__version__, "cuda", torch.cuda.is_available())
print({k: v for k, v in os.environ.items() if any(s in k for s in ("TORCH", "PYTORCH", "DYNAMO", "INDUCTOR", "OMP"))})
for name in ("automatic_dynamic_shapes", "assume_static_by_default", "automatic_dynamic_local_pgo",
             "automatic_dynamic_remote_pgo", "automatic_dynamic_shapes_mark_as", "specialize_int",
             "force_parameter_static_shapes", "cache_size_limit"):
    print(name, getattr(dc, name, "n/a"))
print("mkldnn bf16 matmul", torch.backends.mkldnn.is_available(), getattr(torch.backends.mkldnn, "matmul", None),
      torch.get_float32_matmul_precision())
