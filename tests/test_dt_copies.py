"""dt_proj over a copy of x_proj's first columns (``dt.clone()``, ``torch.cat([dt, B], -1)[..., :R]``)
and Δ's softplus flipped or rolled along other axes than time alone (run 63).

x_dt_proj reads through copies that keep the values and the gradient; a detached, a written or
a returned-and-copied dt is left alone with its reason. The Δ fold gives a reason for a softplus
reordered along channels, batch or by a roll. Every case compares values and every input's
gradient with eager.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from utils import TOL, PassCapture, rel_err

from ssm_compile.kernels.selective_scan.op import selective_scan_fn
from ssm_compile.passes import delta, tail, x_dt_proj

R, N, DIM = 3, 4, 8


def _args():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 7, DIM, generator=g), 0.3 * torch.randn(R + 2 * N, DIM, generator=g),
            torch.randn(DIM, R, generator=g), torch.randn(DIM, generator=g), -torch.rand(DIM, N, generator=g) - 0.5]


def _block(dt_of, returned=False):
    """x_proj, split, ``dt_of(dt, B, W_dt, bias)`` (dt_proj's pre-activation), softplus, scan."""
    def fn(x, w_x, w_dt, bias, A):
        x_dbl = F.linear(x, w_x)
        dt, B, C = x_dbl.split([R, N, N], dim=-1)
        pre = dt_of(dt, B, w_dt, bias)
        y = selective_scan_fn(x.transpose(1, 2), F.softplus(pre).transpose(1, 2), A, B.transpose(1, 2),
                              C.transpose(1, 2))
        return (y, x_dbl) if returned else y
    return fn


def _run(fn, grad=True):
    """The rewritten graph's context, and its outputs and input gradients next to eager's."""
    def once(call):
        leaves = [a.requires_grad_(grad) for a in _args()]
        with torch.set_grad_enabled(grad):
            out = call(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(sum(o.square().sum() for o in outs), leaves) if grad else ()
        return outs, grads

    torch._dynamo.reset()
    cap = PassCapture(delta, tail, x_dt_proj)
    got = once(torch.compile(fn, backend=cap, fullgraph=True))
    want = once(fn)
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert rel_err(g, w.double()) < TOL[torch.float32]
    return cap


def _x_dt_ops(cap):
    return [n for n in cap.gm.graph.nodes if n.target is torch.ops.ssm.x_dt_proj.default]


def _misses(cap, family):
    return [m.reason for m in cap.ctx.misses if m.family == family]


COPIES = {
    "clone": lambda dt, B, w, b: F.linear(dt.clone(), w, b),
    "torch_clone": lambda dt, B, w, b: F.linear(torch.clone(dt), w, b),
    "clone_memory_format": lambda dt, B, w, b: F.linear(dt.clone(memory_format=torch.contiguous_format), w, b),
    "clone_twice": lambda dt, B, w, b: F.linear(dt.clone().clone(), w, b),
    "to_copy": lambda dt, B, w, b: F.linear(dt.to(dt.dtype, copy=True), w, b),
    # .float() of fp32 dt returns dt itself: the copy inside or outside it.
    "float_clone": lambda dt, B, w, b: F.linear(dt.float().clone(), w, b),
    "clone_float": lambda dt, B, w, b: F.linear(dt.clone().float(), w, b),
    "cat_slice": lambda dt, B, w, b: F.linear(torch.cat([dt, B], dim=-1)[..., :R], w, b),
    "cat_split": lambda dt, B, w, b: F.linear(torch.cat((dt.clone(), B), -1).split([R, N], -1)[0], w, b),
    "cat_narrow_copied": lambda dt, B, w, b: F.linear(torch.cat([dt, B], -1).narrow(-1, 0, R).clone(), w, b),
}


def _rows_over_a_copy(x, w_x, w_dt, bias, A):
    """mamba_simple's reference path: x_proj on (batch * L) rows, dt_proj as the 2-D product
    ``W_dt @ dt.t()``, here of a copy of dt."""
    b, L, _ = x.shape
    dt, B, C = F.linear(x.reshape(b * L, DIM), w_x).split([R, N, N], dim=-1)
    dt = (w_dt @ dt.clone().t()).reshape(-1, b, L).permute(1, 0, 2)
    B, C = (t.reshape(b, L, N).transpose(1, 2) for t in (B, C))
    return selective_scan_fn(x.transpose(1, 2), F.softplus(dt + bias[:, None]), A, B, C)


@pytest.mark.parametrize("form", [*COPIES, "rows_product"])
def test_dt_proj_over_a_copy_of_dt_is_rewritten(form):
    cap = _run(_rows_over_a_copy if form == "rows_product" else _block(COPIES[form]))
    assert len(_x_dt_ops(cap)) == 1, (cap.gm.graph, _misses(cap, "x_dt_proj"))
    assert [r.family for r in cap.ctx.rewrites].count("x_dt_proj") == 1


def _written_before(dt, B, w, b):
    c = dt.clone()
    c[..., 0] = 0
    return F.linear(c, w) + b  # bias-free dt_proj: the delta fold leaves the product to x_dt_proj


def _cat_written_after(dt, B, w, b):
    c = torch.cat([dt, B], dim=-1)
    pre = F.linear(c[..., :R], w) + b
    c.mul_(2)  # after dt_proj read it: the op would read dt at x_proj, and the check is on the memory
    return pre


def _copy_without_grad(dt, B, w, b):
    with torch.no_grad():
        c = dt.clone()
    return F.linear(c, w, b)


_DETACHED = (r"dt_proj reads \w+ = x_proj's first columns detached: no gradient reaches x_proj through dt_proj, "
             "where ssm.x_dt_proj's backward would send one")
NEAR_MISSES = {
    # case: (dt_of, x_dbl returned, under grad, the reason's start)
    "detach": (lambda dt, B, w, b: F.linear(dt.detach(), w, b), False, True, _DETACHED),
    "detach_clone": (lambda dt, B, w, b: F.linear(dt.detach().clone(), w, b), False, True, _DETACHED),
    "clone_written_before": (_written_before, False, True, "setitem writes in place to x_proj's output, a weight "
                             "or a copy or view of them the products read"),
    "cat_written_after": (_cat_written_after, False, False, "mul_ writes in place to x_proj's output"),
    # Without grad (a view's write under grad is autograd's error): dt_proj reads x_dbl written.
    "written_through_the_view": (lambda dt, B, w, b: F.linear(dt.mul_(2), w) + b, False, False,
                                 r"dt_proj reads x_proj's first columns as mul_ = \.mul_ writes them in place"),
    "clone_no_grad": (_copy_without_grad, False, True, "the matched nodes span a grad-mode"),
    # x_dbl returned: eager's dt_proj saved the copy, the op would save x_dbl, which the caller may write.
    "clone_of_returned": (lambda dt, B, w, b: F.linear(dt.clone(), w, b), True, True,
                          "clone copies the columns dt_proj reads, and x_dbl's memory is returned"),
    # dt is a narrow piece: .contiguous() copies it (the pass followed it before run 63, returned or not).
    "contiguous_of_returned": (lambda dt, B, w, b: F.linear(dt.contiguous(), w, b), True, True,
                               "contiguous copies the columns dt_proj reads, and x_dbl's memory is returned"),
    "cat_of_returned": (lambda dt, B, w, b: F.linear(torch.cat([dt, B], -1)[..., :R], w, b), True, True,
                        "cat copies the columns dt_proj reads, and x_dbl's memory is returned"),
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_copies_that_are_not_dt_are_left_alone_with_the_reason(case):
    dt_of, returned, grad, reason = NEAR_MISSES[case]
    cap = _run(_block(dt_of, returned), grad)
    assert not _x_dt_ops(cap)
    misses = _misses(cap, "x_dt_proj")
    assert len(misses) == 1 and re.match(reason, misses[0]), misses


def _reordered(reorder, layout):
    """Δ = reorder(softplus(dt_proj(dt))) in a (b, L, dim) or (b, dim, L) layout."""
    def fn(x, w_x, w_dt, bias, A):
        dt, B, C = F.linear(x, w_x).split([R, N, N], dim=-1)
        sp = F.softplus(F.linear(dt, w_dt, bias))
        d = reorder(sp).transpose(1, 2) if layout == "bld" else reorder(sp.transpose(1, 2))
        return selective_scan_fn(x.transpose(1, 2), d, A, B.transpose(1, 2), C.transpose(1, 2))
    return fn


_CHANNELS = "; along channels the op's per-channel delta_bias would have to move with dt_proj's rows"
_VIEWS = "the fold follows Δ back to the softplus only through views and flips of time"
REORDERED = {
    "flip_channels_bld": (lambda d: d.flip(-1), "bld", "flipped along channels: " + _VIEWS + _CHANNELS),
    "flip_channels_bdl": (lambda d: d.flip(1), "bdl", "flipped along channels: " + _VIEWS + _CHANNELS),
    "flip_channels_and_time": (lambda d: d.flip(1, 2), "bdl", "flipped along channels and time: "),
    "flip_batch": (lambda d: torch.flip(d, dims=(0,)), "bld", "flipped along batch: " + _VIEWS + ";"),
    "roll_channels": (lambda d: d.roll(1, -1), "bld", "rolled along channels: " + _VIEWS + _CHANNELS),
    # A roll of time is no reversal: not the time flip the fold reads.
    "roll_time": (lambda d: torch.roll(d, 2, 2), "bdl", "rolled along time: " + _VIEWS
                  + " (a roll is not a reversal); the softplus stays"),
    "roll_flat": (lambda d: d.roll(3), "bld", "rolled as one flat row of elements: "),
}


@pytest.mark.parametrize("case", list(REORDERED))
def test_a_softplus_reordered_but_along_time_gets_the_reason(case):
    reorder, layout, reason = REORDERED[case]
    cap = _run(_reordered(reorder, layout))
    assert "delta" not in [r.family for r in cap.ctx.rewrites]
    misses = _misses(cap, "delta")
    # The reordering node's name, in parentheses, is Dynamo's.
    assert len(misses) == 1 and re.sub(r" \(\w+\):", ":", misses[0], count=1).startswith(
        "Δ is the softplus sp " + reason), misses
