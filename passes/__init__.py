"""The pattern passes that turn Mamba subgraphs into ``ssm`` ops.

Importing this package registers nothing: ``build_pass_manager(options)`` imports the enabled
pass modules and calls each one's ``register(pm)``, in ``PASS_NAMES`` order.
"""
from __future__ import annotations

import importlib

from ssm_compile.config import PASS_NAMES, SSMOptions

from .manager import PassManager


def build_pass_manager(options: SSMOptions | None = None) -> PassManager:
    """A ``PassManager`` running the enabled passes of ``options`` (default: all) in order.

    Args:
        options: the backend's validated options; ``None`` means ``SSMOptions()``.
    Returns:
        the manager; ``pm.uuid()`` hashes the passes' sources and ``options.pass_options()``.
    Example:
        >>> pm = build_pass_manager(SSMOptions(passes=("conv1d",)))
        >>> ctx = pm(gm)  # rewrites gm in place; ctx.rewrites / ctx.misses say what happened
    """
    options = options or SSMOptions()
    pm = PassManager(options.pass_options())
    for name in options.enabled_passes:
        importlib.import_module(f"{__name__}.{name}").register(pm)
    return pm


__all__ = ["PASS_NAMES", "PassManager", "build_pass_manager"]
