"""The ``ssm`` torch.compile backend.

``torch.compile(model, backend="ssm")`` finds this module through the ``torch_dynamo_backends``
entry point, so user code needs no import of ours. The backend runs the pattern passes on
dynamo's FX graph (before AOTAutograd, so every ``ssm`` op is one node that brings its own
autograd formula) and hands the rewritten graph to inductor, which still fuses everything else.

``ssm_compile.backend(**options)`` returns a configured backend:

    model = torch.compile(model, backend=ssm_compile.backend(inductor=False))
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

import torch

from .config import SSMOptions

log = logging.getLogger("ssm_compile")


@dataclasses.dataclass
class GraphRecord:
    """What the passes did to one dynamo graph (collected by ``ssm_compile.explain``)."""

    before: str
    after: str
    rewrites: list
    misses: list
    options: dict


def _code(gm: torch.fx.GraphModule) -> str:
    """The graph's Python code, followed by that of its subgraphs (checkpointed layers are one),
    whose rewrites a reader would otherwise not see."""
    parts = [gm.code]
    for name, sub in gm.named_children():
        if isinstance(sub, torch.fx.GraphModule):
            parts.append(f"\n# subgraph {name}\n{sub.code}")
    return "".join(parts)


class SSMBackend:
    """A configured ``ssm`` backend: ``backend(gm, example_inputs) -> compiled callable``.

    Args:
        options: validated ``SSMOptions``.
        on_graph: called with a ``GraphRecord`` for every graph compiled (``explain`` uses it);
            recording costs a graph print, so it is off unless asked for.
    """

    def __init__(self, options: SSMOptions | None = None,
                 on_graph: Callable[[GraphRecord], None] | None = None):
        self.options = options or SSMOptions()
        self.on_graph = on_graph

    def pass_manager(self):
        from ssm_compile.passes import build_pass_manager

        return build_pass_manager(self.options)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from ssm_compile.kernels import register_ops

        # The rewritten graph calls torch.ops.ssm.*, which must exist before it is traced.
        register_ops()
        pm = self.pass_manager()
        before = _code(gm) if self.on_graph is not None else ""
        ctx = pm(gm)
        log.info("ssm backend: %d rewrite(s), %d near-miss(es) in a graph of %d nodes",
                 len(ctx.rewrites), len(ctx.misses), len(gm.graph.nodes))
        if self.on_graph is not None:
            self.on_graph(GraphRecord(before=before, after=_code(gm), rewrites=list(ctx.rewrites),
                                      misses=list(ctx.misses), options=dict(pm.options)))
        if not self.options.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=self.config_patches(pm))

    def config_patches(self, pm) -> dict[str, Any]:
        """Inductor config patches for one compile, with the pass manager's cache-key pass."""
        import torch._inductor.config as inductor_config

        patches = self.options.config_patches()
        inner = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
        patches["post_grad_custom_post_pass"] = pm.cache_key_pass(inner)
        return patches

    def __repr__(self) -> str:
        return f"SSMBackend({self.options})"


def backend(**options: Any) -> SSMBackend:
    """A configured ``ssm`` backend, to pass as ``torch.compile(model, backend=...)``.

    Args:
        **options: ``SSMOptions`` fields (``fuse``, ``passes``, ``disable``, ``inductor``,
            ``mode``, ``inductor_config``); any other key is an inductor config patch.
    Returns:
        an ``SSMBackend``; its options were validated here, so typos fail now.
    Example:
        >>> model = torch.compile(model, backend=ssm_compile.backend(disable={"xproj"}))
    """
    return SSMBackend(SSMOptions.from_kwargs(**options))


def ssm_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """The ``backend="ssm"`` entry point; ``torch.compile``'s ``mode``/``options`` land here."""
    return SSMBackend(SSMOptions.from_kwargs(mode=mode, options=options))(gm, example_inputs)


# Must run before dynamo traces the first frame for backend="ssm"; this import (through the
# entry point, or ssm_compile.backend) is the only code of ours that runs that early. See
# dynamo_compat for why, and for how the change stays limited to our own traces.
from . import dynamo_compat  # noqa: E402  (kept beside the install() call it is imported for)

dynamo_compat.install()

