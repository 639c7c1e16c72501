"""Tensor hooks under compiled autograd, and on the scan's output (probe BA, run 52).

With ``torch._dynamo.config.compiled_autograd = True`` dynamo records ``t.register_hook(fn)`` on an
intermediate tensor as a call nothing reads, ``_register_hook_trampoline(t, backward_state)``,
and t flows on to its other users unchanged. The passes folded such a t into the op (the delta
fold took a hooked softplus(dt), the discretization a hooked exp(Δ·A)) and the hook, left on a
tensor the backward no longer reached, never ran: gradients off by the hook's factor under
``backend(inductor=False)`` (the default backend fell back to the unrewritten graph because
inductor could not compile the rewritten one, correct by accident). A graph with such a hook is
now left as traced, with a reason.

Without compiled autograd dynamo wraps a hooked tensor in ``register_hook``'s higher-order op,
which the matchers refuse by name (``tests/test_unseen_train_decode.py`` and the explain reasons
below).
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo import compiled_autograd

from ssm_compile.compiler import backend
from ssm_compile.report import explain

BATCH, L, DIM, N = 2, 3, 4, 3


def block(u, dt, A, B, C, D, z, dt_bias, hook_on):
    dt = F.softplus(dt + dt_bias)
    if hook_on == "dt":
        dt.register_hook(lambda g: g * 2)
    dA = torch.exp(torch.einsum("bld,dn->bldn", dt, A))
    if hook_on == "dA":
        dA.register_hook(lambda g: g * 3)
    dBu = torch.einsum("bld,bln,bld->bldn", dt, B, u)
    h = u.new_zeros(u.shape[0], u.shape[2], A.shape[1])
    ys = []
    for t in range(u.shape[1]):
        h = dA[:, t] * h + dBu[:, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
    y = torch.stack(ys, 1)
    if hook_on == "y":
        y.register_hook(lambda g: g * 0.5)
    return (y + u * D) * F.silu(z)


def inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, L, DIM, generator=g, dtype=torch.float64),
            torch.randn(BATCH, L, DIM, generator=g, dtype=torch.float64) * 0.5,
            -torch.rand(DIM, N, generator=g, dtype=torch.float64) - 0.5,
            torch.randn(BATCH, L, N, generator=g, dtype=torch.float64),
            torch.randn(BATCH, L, N, generator=g, dtype=torch.float64),
            torch.randn(DIM, generator=g, dtype=torch.float64),
            torch.randn(BATCH, L, DIM, generator=g, dtype=torch.float64),
            torch.randn(DIM, generator=g, dtype=torch.float64) * 0.3]


def grads(fn, hook_on, compiled_backward):
    xs = [a.clone().requires_grad_() for a in inputs()]
    loss = fn(*xs, hook_on=hook_on).pow(2).sum()
    if compiled_backward:
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
    else:
        loss.backward()
    return [x.grad for x in xs]


@pytest.mark.parametrize("hook_on", ["dt", "dA", None])
def test_hooks_under_compiled_autograd_keep_their_gradients(hook_on):
    # torch's own config patch: a monkeypatch of the config module's attribute is undone by a
    # delattr that, in some pytest versions, hides the option from every later compile.
    with torch._dynamo.config.patch(compiled_autograd=True):
        _check_hooks_under_compiled_autograd(hook_on)


def _check_hooks_under_compiled_autograd(hook_on):
    want = grads(block, hook_on, compiled_backward=False)
    torch._dynamo.reset()
    got = grads(torch.compile(block, backend=backend(inductor=False)), hook_on, compiled_backward=True)
    torch._dynamo.reset()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    report = explain(lambda *a: block(*a, hook_on=hook_on), *[a.requires_grad_() for a in inputs()])
    torch._dynamo.reset()
    blocked = [m for m in report.misses if "compiled autograd registers backward hooks" in m.reason]
    if hook_on is None:
        # No hook, no trampoline: the block is rewritten as ever.
        assert not blocked and report.counts.get("scan_loop") == 1, report.format(graphs=False)
    else:
        assert blocked and not report.rewrites, report.format(graphs=False)


def test_a_hook_on_y_keeps_the_skip_and_gate_out_with_a_reason():
    # Without compiled autograd: the scan is rewritten, the hook stays on its output, and the
    # skip and gate after the hook are not folded (they would bypass it), each with a reason.
    want = grads(block, "y", compiled_backward=False)
    torch._dynamo.reset()
    got = grads(torch.compile(block, backend=backend(inductor=False)), "y", compiled_backward=False)
    torch._dynamo.reset()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    report = explain(lambda *a: block(*a, hook_on="y"), *[a.requires_grad_() for a in inputs()])
    torch._dynamo.reset()
    assert report.counts.get("scan_loop") == 1 and not report.counts.get("skip") and not report.counts.get("gate")
    for family in ("skip", "gate"):
        assert any(m.family == family and "passes through torch.ops.higher_order." in m.reason
                   for m in report.misses), report.format(graphs=False)
