"""Forward-mode AD through every ``ssm`` op: a clear error that names the op, never a lost tangent.

The ops have no forward-mode formula. Three APIs carry tangents: ``torch.autograd.forward_ad``
dual tensors, and ``torch.func.jvp`` / ``jacfwd``, which wrap the tangents at their own
functorch level (the kernels below autograd see only the primals). ``x_dt_proj`` and
``fused_mamba_scan`` once returned zero tangents under ``torch.func.jvp`` and ``jacfwd``, and
``fused_mamba_scan`` a ``None`` tangent under ``forward_ad``: torch's generated autograd kernel
redispatches below autograd whenever nothing requires grad.

vmap of the forward (no tangent) must keep working: checked against a loop over the batch.
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

from ssm_compile.kernels import register_ops

BATCH, DIM, L, N, W, R = 2, 4, 5, 3, 4, 2


@pytest.fixture(scope="module", autouse=True)
def _ops():
    register_ops()


def _inputs():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(
        u=r(BATCH, DIM, L), delta=r(BATCH, DIM, L) * 0.5 - 1, A=-torch.exp(r(DIM, N) * 0.5),
        B=r(BATCH, N, L), C=r(BATCH, N, L), D=r(DIM), z=r(BATCH, DIM, L), delta_bias=r(DIM) * 0.3,
        h0=r(BATCH, DIM, N), conv_w=r(DIM, W), conv_b=r(DIM), state=r(BATCH, DIM, N),
        x_step=r(BATCH, DIM), dt_step=r(BATCH, DIM), B_step=r(BATCH, N), C_step=r(BATCH, N),
        conv_state=r(BATCH, DIM, W), x_rows=r(BATCH, L, DIM), x_w=r(R + 2 * N, DIM), dt_w=r(DIM, R),
        dt_low=r(BATCH, R, L),
    )


I = _inputs()
ops = torch.ops.ssm

# name -> (the op's name in the error, a function of one tensor, that tensor)
CASES = {
    "selective_scan(u)": ("ssm::selective_scan", lambda u: ops.selective_scan(
        u, I["delta"], I["A"], I["B"], I["C"], I["D"], I["z"], I["delta_bias"], True, None, False)[0], I["u"]),
    "selective_scan(initial_state)": ("ssm::selective_scan", lambda h0: ops.selective_scan(
        I["u"], I["delta"], I["A"], I["B"], I["C"], None, None, None, False, h0, True)[1], I["h0"]),
    "causal_conv1d(weight)": ("ssm::causal_conv1d", lambda w: ops.causal_conv1d(
        I["u"], w, I["conv_b"], "silu", None), I["conv_w"]),
    "selective_state_update(x)": ("ssm::selective_state_update", lambda x: ops.selective_state_update(
        I["state"].clone(), x, I["dt_step"], I["A"], I["B_step"], I["C_step"], None, None, None, True), I["x_step"]),
    "selective_state_update_functional(state)": (
        "ssm::selective_state_update_functional", lambda s: ops.selective_state_update_functional(
            s, I["x_step"], I["dt_step"], I["A"], I["B_step"], I["C_step"], None, None, None, True)[1], I["state"]),
    "causal_conv1d_update(x)": ("ssm::causal_conv1d_update", lambda x: ops.causal_conv1d_update(
        x, I["conv_state"].clone(), I["conv_w"], I["conv_b"], "silu"), I["x_step"]),
    "causal_conv1d_update_functional(x)": (
        "ssm::causal_conv1d_update_functional", lambda x: ops.causal_conv1d_update_functional(
            x, I["conv_state"], I["conv_w"], I["conv_b"], "silu")[0], I["x_step"]),
    "round_through(x)": ("ssm::round_through", lambda x: ops.round_through(x, torch.bfloat16), I["u"]),
    "x_dt_proj(x)": ("ssm::x_dt_proj", lambda x: ops.x_dt_proj(x, I["x_w"], I["dt_w"])[1], I["x_rows"]),
    "x_dt_proj(x_weight)": ("ssm::x_dt_proj", lambda w: ops.x_dt_proj(I["x_rows"], w, I["dt_w"])[0], I["x_w"]),
    "fused_mamba_scan(conv level, x)": ("ssm::fused_mamba_scan", lambda x: ops.fused_mamba_scan(
        x, I["delta"], I["A"], I["B"], I["C"], I["D"], I["z"], I["delta_bias"], True, I["conv_w"],
        I["conv_b"], "silu", None, None, False)[0], I["u"]),
    "fused_mamba_scan(dt level, dt_weight)": ("ssm::fused_mamba_scan", lambda w: ops.fused_mamba_scan(
        I["u"], I["dt_low"], I["A"], I["B"], I["C"], I["D"], I["z"], I["delta_bias"], True, None, None,
        None, w, None, False)[0], I["dt_w"]),
}


def _dual(f, x, t):
    with fwAD.dual_level():
        return fwAD.unpack_dual(f(fwAD.make_dual(x, t))).tangent


APIS = {
    "forward_ad": _dual,
    "func.jvp": lambda f, x, t: torch.func.jvp(f, (x,), (t,))[1],
    "func.jacfwd": lambda f, x, t: torch.func.jacfwd(f)(x),
}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", CASES)
def test_tangent_is_refused_naming_the_op(case, api):
    name, f, x = CASES[case]
    f(x)  # the primal call itself works
    with pytest.raises(RuntimeError, match=f"^{name}: forward-mode AD"):
        APIS[api](f, x, torch.randn_like(x))


@pytest.mark.parametrize("case", ["x_dt_proj(x)", "fused_mamba_scan(conv level, x)", "selective_scan(u)",
                                  "round_through(x)"])
def test_vmap_of_the_forward_still_works(case):
    _, f, x = CASES[case]
    stacked = torch.stack([x, x * 0.5 + 0.1])
    expected = torch.stack([f(stacked[0]), f(stacked[1])])
    torch.testing.assert_close(torch.vmap(f)(stacked), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["x_dt_proj(x)", "fused_mamba_scan(conv level, x)", "round_through(x)"])
def test_functorch_grad_is_refused_naming_the_op(case):
    """torch's generated autograd kernel, under torch.func.grad, fails with torch's generic
    "must override the setup_context staticmethod"; the ops name themselves instead."""
    name, f, x = CASES[case]
    with pytest.raises(RuntimeError, match=f"^{name}: torch.func transforms"):
        torch.func.grad(lambda t: f(t).sum())(x)
