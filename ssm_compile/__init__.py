"""ssm-compile: a torch.compile backend that makes unmodified Mamba code fast.

``torch.compile(model, backend="ssm")`` needs no import of this package (dynamo finds the
backend through the ``torch_dynamo_backends`` entry point). Importing it stays light: the public
names below are loaded on first use, and no op is registered until something needs one.
"""
import importlib

_EXPORTS = {
    "selective_scan_fn": "ssm_compile.kernels.selective_scan.op",
    "causal_conv1d_fn": "ssm_compile.kernels.causal_conv1d.op",
    "selective_state_update": "ssm_compile.kernels.decode.op",
    "causal_conv1d_update": "ssm_compile.kernels.decode.op",
    "register_ops": "ssm_compile.kernels",
    "backend": "ssm_compile.compiler",
    "explain": "ssm_compile.report",
    "SSMOptions": "ssm_compile.config",
    "PASS_NAMES": "ssm_compile.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ssm_compile' has no attribute {name!r}")
