"""``ssm_compile.explain``: what the ``ssm`` backend did to a model, and why it left things alone.

    report = ssm_compile.explain(model, input_ids)
    print(report)                      # rewrites, near-misses with reasons, graphs before/after
    report.counts                      # Counter({"conv1d": 2, "scan_loop": 2, ...})
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable

import torch

from .compiler import GraphRecord, SSMBackend
from .config import SSMOptions

log = logging.getLogger("ssm_compile")


@dataclasses.dataclass
class Report:
    """Per dynamo graph: the rewrites, the near-misses, and the graph before and after the passes.

    Attributes:
        graphs: one ``GraphRecord`` per graph dynamo compiled, in compile order.
        graph_breaks: dynamo's graph-break reasons seen during the run, with counts.
        output: what the model returned on the explained run.
        untraced: where dynamo ran a frame eagerly, what it could not trace, with dynamo's counts
            of its tries. A graph break inside a loop does that (``print`` or ``retain_grad()`` in
            the time loop): no graph and no graph break is recorded, so without these the report
            would be empty.
    """

    graphs: list[GraphRecord]
    graph_breaks: dict[str, int]
    output: Any = dataclasses.field(default=None, repr=False)
    untraced: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def rewrites(self) -> list:
        return [r for g in self.graphs for r in g.rewrites]

    @property
    def misses(self) -> list:
        return [m for g in self.graphs for m in g.misses]

    @property
    def counts(self) -> collections.Counter:
        """Rewrites per family, as ``counters["ssm"]`` would count them."""
        return collections.Counter(r.family for r in self.rewrites)

    def summary(self) -> str:
        counts = ", ".join(f"{family} x{n}" for family, n in sorted(self.counts.items())) or "none"
        untraced = ", frames run eagerly (below)" if self.untraced else ""
        return (f"ssm_compile.explain: {len(self.graphs)} graph(s), {sum(self.graph_breaks.values())} "
                f"graph break(s), {len(self.rewrites)} rewrite(s) [{counts}], {len(self.misses)} near-miss(es)"
                + untraced)

    def __str__(self) -> str:
        return self.format(graphs=True)

    def format(self, graphs: bool = True) -> str:
        """The readable account; ``graphs=False`` leaves out the graph text (long for big models)."""
        lines = [self.summary()]
        for reason, n in self.graph_breaks.items():
            lines.append(f"  graph break x{n}: {reason}")
        for reason in self.untraced:
            # Not counted: dynamo tries a frame again after some failures, and counts each try.
            lines.append(f"  not traced, and a frame ran eagerly (no backend saw it): {reason}")
        for i, g in enumerate(self.graphs, 1):
            lines.append(f"\n== graph {i} (options: {g.options}) ==")
            lines.append("rewrites:" if g.rewrites else "rewrites: none")
            for r in g.rewrites:
                decision = ", ".join(f"{k}={v}" for k, v in r.decision.items())
                lines.append(f"  [{r.family}] {r.pattern} -> {r.emitted}: replaced {len(r.replaced)} node(s) "
                             f"({_names(r.replaced)})" + (f"; decision: {decision}" if decision else ""))
            lines.append("near-misses:" if g.misses else "near-misses: none")
            for m in g.misses:
                where = f" (at {_names(m.nodes)})" if m.nodes else ""
                lines.append(f"  [{m.family}] {m.reason}{where}")
            if any(word in m.reason for m in g.misses for word in ("A_full", "B_full", "C_full")):
                lines.append(f"  ({_FULL_NAMES})")
            if graphs:
                lines.append("-- graph before --")
                lines.append(g.before.strip("\n"))
                lines.append("-- graph after --")
                lines.append(g.after.strip("\n"))
        return "\n".join(lines) + "\n"


# The scan passes' reasons name the step's terms by what they are for every step at once.
_FULL_NAMES = ("A_full, B_full: the decay exp(Δ·A) and the input term Δ·B·u of every step, (batch, dim, time, "
               "state); C_full: C of every step; X_full[t] is step t's slice, precomputed or computed in the step")


def _names(nodes: list[str], limit: int = 8) -> str:
    # An unrolled loop replaces hundreds of nodes; the first few say where it was.
    if len(nodes) <= limit:
        return ", ".join(nodes)
    return ", ".join(nodes[:limit]) + f", ... ({len(nodes) - limit} more)"


def explain(model_or_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Compile ``model_or_fn`` with a recording ``ssm`` backend, run it once on the inputs, report.

    The rewritten graphs run eagerly (``inductor=False``): the passes, and so the report, are the
    same as under ``backend="ssm"``, without paying for inductor. Dynamo's caches are reset before
    and after, so that the report sees fresh graphs and nothing it compiled is reused later; a
    function compiled before explaining recompiles at its next call. Dynamo's counters
    (``counters["ssm"]``, graph breaks, stats) are restored to what they were.

    Args:
        model_or_fn: an ``nn.Module`` or a function, unmodified.
        *args, **kwargs: what to call it with.
    Returns:
        a ``Report``; ``str(report)`` is the human-readable account.
    Example:
        >>> print(ssm_compile.explain(model, input_ids))
    """
    from torch._dynamo.utils import counters

    records: list[GraphRecord] = []
    saved = {name: collections.Counter(counts) for name, counts in counters.items()}
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model_or_fn, backend=SSMBackend(SSMOptions(inductor=False), on_graph=records.append))
        output = compiled(*args, **kwargs)
        breaks = collections.Counter(counters["graph_break"])
        breaks.subtract(saved.get("graph_break", {}))
        untraced = collections.Counter(counters["unimplemented"])
        untraced.subtract(saved.get("unimplemented", {}))
        frames = collections.Counter(counters["frames"])
        frames.subtract(saved.get("frames", {}))
    finally:
        torch._dynamo.reset()
        # Every counter as it was (ssm, graph_break, stats, ...): explaining is not compiling.
        # In place: a caller may hold one of the Counter objects.
        for name, counts in counters.items():
            counts.clear()
            counts.update(saved.get(name, {}))
    breaks = {k: v for k, v in breaks.items() if v > 0}
    untraced = _untraced_reasons(untraced)
    if frames["total"] <= frames["ok"]:
        # Every frame gave a graph: what dynamo could not trace split a graph (a data-dependent
        # ``if``, which dynamo counts only as "unimplemented"), it ran no frame eagerly.
        told = {_first_lines(k) for k in breaks}
        breaks.update({k: v for k, v in untraced.items() if k not in told})
        untraced = {}
    report = Report(graphs=records, graph_breaks=breaks, output=output, untraced=untraced)
    log.info("%s", report.summary())
    return report


def _first_lines(reason: str) -> str:
    """A reason of dynamo's cut to its title and explanation (the hints after them run to
    paragraphs)."""
    return " ".join([line.strip() for line in str(reason).splitlines() if line.strip()][:2])


def _untraced_reasons(counts: collections.Counter) -> dict[str, int]:
    """Dynamo's reasons for what it could not trace, each cut by ``_first_lines``."""
    reasons: collections.Counter = collections.Counter()
    for reason, n in counts.items():
        if n > 0:
            reasons[_first_lines(reason)] += n
    return dict(reasons)
