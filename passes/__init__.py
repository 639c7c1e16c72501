"""The pattern passes that turn Mamba subgraphs into ``ssm`` ops.

Importing this package registers nothing: ``build_pass_manager(options)`` imports the enabled
pass modules and calls each one's ``register(pm)``, in ``PASS_NAMES`` order.
"""
from __future__ import annotations

import importlib
import logging

from ssm_compile.config import PASS_NAMES, SSMOptions

from .manager import PassManager

log = logging.getLogger("ssm_compile")


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
        module_name = f"{__name__}.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # A pass module that is not part of this build: its patterns stay as they are
            # (inductor still compiles them), which is slower but never wrong. Anything else
            # failing inside the module is a real error and propagates.
            if e.name != module_name:
                raise
            log.warning("ssm pass module %s is not available; its patterns will not be rewritten", name)
            continue
        module.register(pm)
    return pm


__all__ = ["PASS_NAMES", "PassManager", "build_pass_manager"]
