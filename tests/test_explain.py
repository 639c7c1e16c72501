"""``ssm_compile.explain``: the report of rewrites and near-misses, and no state left behind."""
import logging

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ssm_compile.compiler import backend
from ssm_compile.report import explain


def causal_conv(x, w, b):
    return F.silu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]])


def shifted_conv(x, w, b):
    # Padding W-2 sees one future step: a near-miss the report must explain.
    return F.conv1d(x, w, b, padding=w.shape[-1] - 2, groups=x.shape[1])[..., :x.shape[-1] - 1]


def two_graphs(x, w, b):
    y = causal_conv(x, w, b)
    torch._dynamo.graph_break()
    return shifted_conv(y, w, b)


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 6, 9, generator=g), torch.randn(6, 1, 4, generator=g) / 4, torch.randn(6, generator=g)


def test_report_of_a_rewrite():
    report = explain(causal_conv, *inputs())
    assert len(report.graphs) == 1 and report.counts == {"conv1d": 1} and not report.misses
    (rewrite,) = report.rewrites
    assert rewrite.emitted == "ssm.causal_conv1d" and rewrite.decision == {"W": 4, "activation": "silu", "bias": True}
    text = str(report)
    assert "1 rewrite(s) [conv1d x1], 0 near-miss(es)" in text
    assert ("[conv1d] conv1d[..., :L]+silu -> ssm.causal_conv1d: replaced 3 node(s) (conv1d, getitem, silu); "
            "decision: W=4, activation=silu, bias=True") in text
    before, after = text.split("-- graph before --")[1].split("-- graph after --")
    assert "torch.conv1d" in before and "causal_conv1d" not in before
    assert "torch.ops.ssm.causal_conv1d.default" in after and "torch.conv1d" not in after
    torch.testing.assert_close(report.output, causal_conv(*inputs()))
    short = report.format(graphs=False)
    assert "decision: W=4" in short and "-- graph before --" not in short


def test_report_of_a_near_miss():
    report = explain(shifted_conv, *inputs())
    assert not report.rewrites
    (miss,) = report.misses
    assert miss.family == "conv1d" and miss.nodes == ["conv1d"]
    assert "[conv1d] padding 2 is not kernel_size - 1 = 3: not a causal conv (at conv1d)" in str(report)


def test_report_across_a_graph_break():
    report = explain(two_graphs, *inputs())
    assert len(report.graphs) == 2 and sum(report.graph_breaks.values()) == 1
    assert [len(g.rewrites) for g in report.graphs] == [1, 0] and [len(g.misses) for g in report.graphs] == [0, 1]
    assert "== graph 2" in str(report) and "graph break x1" in str(report)


def scan_with_a_break_in_the_loop(u, delta, A, B, C):
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        if t == 2:
            torch._dynamo.graph_break()  # as a print or retain_grad() in the loop would
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=2)


def test_report_of_a_frame_dynamo_ran_eagerly():
    """A graph break inside a loop makes dynamo run the whole frame eagerly: no graph, no graph
    break recorded. The report said "0 graph(s), 0 graph break(s)" and nothing else (probe BF,
    run 53); it now gives dynamo's reason."""
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 5, generator=g), torch.rand(2, 4, 5, generator=g), -torch.rand(4, 3, generator=g),
            torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g))
    counters["unimplemented"]["an older reason"] = 3
    report = explain(scan_with_a_break_in_the_loop, *args)
    assert not report.graphs and not report.graph_breaks
    assert len(report.untraced) == 1 and "an older reason" not in report.untraced
    (reason,) = report.untraced
    assert "graph_break" in reason, reason
    text = report.format(graphs=False)
    assert "frames run eagerly (below)" in text.splitlines()[0]
    assert f"not traced, and a frame ran eagerly (no backend saw it): {reason}" in text
    torch.testing.assert_close(report.output, scan_with_a_break_in_the_loop(*args))
    # The caller's counters are left as they were.
    assert dict(counters["unimplemented"]) == {"an older reason": 3}


def scan_then_branch(u, delta, A, B, C):
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=2)
    if y.sum() > 0:  # data-dependent: dynamo splits the graph here and counts it only as "unimplemented"
        return y * 2
    return y


def test_a_data_dependent_branch_is_a_graph_break_not_an_eager_frame():
    """Probe BH, run 53: the report said "0 graph break(s)" and "frame run eagerly" for a graph
    dynamo did compile, scan rewritten, before the branch."""
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 4, 5, generator=g), torch.rand(2, 4, 5, generator=g), -torch.rand(4, 3, generator=g),
            torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g))
    report = explain(scan_then_branch, *args)
    assert report.counts["scan_loop"] == 1 and not report.untraced, report.format(graphs=False)
    assert sum(report.graph_breaks.values()) == 1 and "Data-dependent" in next(iter(report.graph_breaks))
    torch.testing.assert_close(report.output, scan_then_branch(*args))


def test_explain_leaves_no_state_behind(caplog):
    counters["ssm"]["conv1d"] = 7
    with caplog.at_level(logging.INFO, logger="ssm_compile"):
        explain(causal_conv, *inputs())
    assert "ssm_compile.explain: 1 graph(s)" in caplog.text
    # The counters are the caller's again, and the next compile of the same function recompiles
    # with its own backend instead of reusing the explain run's eager graph.
    assert counters["ssm"]["conv1d"] == 7
    graphs_before = counters["stats"]["unique_graphs"]
    out = torch.compile(causal_conv, backend=backend(inductor=False, disable={"conv1d"}))(*inputs())
    assert counters["ssm"]["conv1d"] == 7 and counters["stats"]["unique_graphs"] == graphs_before + 1
    torch.testing.assert_close(out, causal_conv(*inputs()))


def test_long_node_lists_are_shortened():
    from ssm_compile.report import _names

    assert _names([f"n{i}" for i in range(3)]) == "n0, n1, n2"
    assert _names([f"n{i}" for i in range(20)]) == "n0, n1, n2, n3, n4, n5, n6, n7, ... (12 more)"


def test_package_level_explain_after_submodule_import():
    # Importing the implementing module must not rebind the package's `explain` function.
    import ssm_compile
    import ssm_compile.report  # noqa: F401

    report = ssm_compile.explain(causal_conv, *inputs())
    assert report.counts == {"conv1d": 1}


def test_doubling_scan_gets_a_scan_reason():
    # An out-of-place Hillis-Steele scan is no pattern the scan passes prove; explain must still
    # say why its exp(Δ·A) stayed, instead of reporting nothing.
    def block(x, delta, A, B, C):
        a = torch.exp(delta.unsqueeze(-1) * A[:, None, :])
        b = delta.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1)
        s = 1
        while s < a.shape[2]:
            b = a * F.pad(b[:, :, :-s], (0, 0, s, 0)) + b
            a = a * F.pad(a[:, :, :-s], (0, 0, s, 0), value=1.0)
            s *= 2
        return (b * C.unsqueeze(1)).sum(-1)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 8, generator=g), torch.rand(2, 4, 8, generator=g), -torch.rand(4, 3, generator=g),
            torch.randn(2, 8, 3, generator=g), torch.randn(2, 8, 3, generator=g))
    report = explain(block, *args)
    assert not report.rewrites
    (miss,) = [m for m in report.misses if m.family == "scan"]
    assert "no scan over it was recognised" in miss.reason and "(2, 4, 8, 3)" in miss.reason
    torch.testing.assert_close(report.output, block(*args))


def test_no_near_miss_for_a_graph_without_a_scan():
    """A residual switch-MoE layer and an RMSNorm: ``bmm(...)[:, 0] * top_p`` slices an axis of
    size 1, and the norm multiplies by it, which once read as a one-step loop and was reported as
    a decode step left alone. Only a decay that is an exp makes a one-step candidate."""
    g = torch.Generator().manual_seed(0)
    d, E, hidden = 8, 3, 12
    router = torch.randn(d, E, generator=g)
    w1, w2 = torch.randn(E, d, hidden, generator=g), torch.randn(E, hidden, d, generator=g)

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    def moe_layer(x):
        b, L, _ = x.shape
        xf = rms(x).reshape(-1, d)
        top_p, top_i = (xf @ router).softmax(-1).max(-1)
        out = torch.bmm(torch.nn.functional.gelu(torch.bmm(xf[:, None], w1[top_i])), w2[top_i])[:, 0] * top_p[:, None]
        return rms(x + out.reshape(b, L, d))

    x = torch.randn(2, 5, d, generator=g)
    report = explain(moe_layer, x)
    assert report.misses == [] and report.rewrites == []
    torch.testing.assert_close(report.output, moe_layer(x))
