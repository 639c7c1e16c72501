"""The pass manager: runs the pattern passes in order and records what each one did.

Every rewrite bumps ``torch._dynamo.utils.counters["ssm"][family]``; every miss keeps its
reason so that ``ssm_compile.explain`` can say why a near-miss was left alone.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters

log = logging.getLogger("ssm_compile")

PassFn = Callable[[torch.fx.GraphModule, "PassContext"], None]


@dataclasses.dataclass
class Rewrite:
    family: str
    pattern: str
    replaced: list[str]
    emitted: str
    decision: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Miss:
    family: str
    reason: str
    nodes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PassContext:
    """What the passes share for one graph: the options, and the record of rewrites and misses."""

    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    misses: list[Miss] = dataclasses.field(default_factory=list)

    def rewrite(self, family: str, pattern: str, replaced: list[torch.fx.Node], emitted: str,
                decision: dict[str, Any] | None = None) -> None:
        names = [n.name for n in replaced]
        self.rewrites.append(Rewrite(family, pattern, names, emitted, decision or {}))
        counters["ssm"][family] += 1
        log.debug("ssm rewrite %s (%s): %d nodes -> %s", family, pattern, len(names), emitted)

    def miss(self, family: str, reason: str, nodes: list[torch.fx.Node] = ()) -> None:
        self.misses.append(Miss(family, reason, [n.name for n in nodes]))
        log.debug("ssm near-miss %s: %s", family, reason)


class PassManager:
    """An ordered list of named passes. Pass modules add themselves through ``register(pm)``."""

    def __init__(self, options: dict[str, Any] | None = None):
        self.options = dict(options or {})
        self.passes: list[tuple[str, PassFn]] = []

    def add(self, name: str, fn: PassFn) -> None:
        self.passes.append((name, fn))

    def __call__(self, gm: torch.fx.GraphModule) -> PassContext:
        ctx = PassContext(options=self.options)
        for name, fn in self.passes:
            fn(gm, ctx)
            gm.graph.lint()
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return ctx

    def uuid(self) -> str:
        """Hash of every pass's module source and the options, for inductor's cache keys."""
        h = hashlib.sha256()
        for name, fn in self.passes:
            h.update(name.encode())
            h.update(inspect.getsource(inspect.getmodule(fn)).encode())
        h.update(repr(sorted(self.options.items())).encode())
        return h.hexdigest()
