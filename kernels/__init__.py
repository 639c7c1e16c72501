"""The ``ssm`` custom ops: Triton kernels on CUDA, chunked PyTorch on CPU.

Nothing is registered when this package is imported. ``register_ops()`` defines every
``torch.ops.ssm.*`` op once; the public wrappers and the backend call it before use.
"""
import functools


@functools.cache
def register_ops() -> None:
    """Define all ``ssm`` ops (idempotent)."""
    from .causal_conv1d import op as causal_conv1d_op
    from .decode import op as decode_op
    from .fused import op as fused_op
    from .selective_scan import op as selective_scan_op
    from .x_dt_proj import op as x_dt_proj_op

    selective_scan_op.register()
    causal_conv1d_op.register()
    decode_op.register()
    fused_op.register()
    x_dt_proj_op.register()
