"""Edge inputs that the ops' Triton launchers and CPU paths got wrong (adversarial probe, run 37).

Each case compares the Triton launcher (the CUDA path's kernels; under TRITON_INTERPRET=1 on a
CPU-only machine, set by conftest) with the CPU path, which follows eager's arithmetic:
- the scan backward read D and delta_bias at unit stride, so an expanded or sliced parameter
  gave wrong du/dz (and an expanded delta_bias wrong everything);
- the scan forward's last state was NaN when A holds -inf (an overflowed -exp(A_log)) and L
  does not fill the last chunk: the padded steps' dt = 0 met A = -inf;
- an infinite dt * u gave y = NaN instead of +-inf when N is not a power of two: the padded
  state lanes (B = C = 0) held NaN, which the readout summed;
- dim = 0: the scan backward divided by zero, and the CPU conv update called F.conv1d with
  groups = 0;
- a decode state whose elements share memory (an expanded batch of one state) was accepted,
  and each row's update raced the others'.
"""
import pytest
import torch

from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.kernels.fused.triton_fused import fused_scan_fwd
from ssm_compile.kernels.selective_scan import cpu, triton_bwd, triton_fwd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _scan_inputs(b=2, d=4, L=7, N=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, z, dy = (torch.randn(b, d, L, generator=g) for _ in range(3))
    delta = torch.randn(b, d, L, generator=g) * 0.5 - 1
    A = -torch.rand(d, N, generator=g) - 0.2
    B, C = (torch.randn(b, 1, N, L, generator=g) for _ in range(2))
    return u, delta, z, dy, A, B, C


def _dev(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("which", ["D sliced", "D expanded", "delta_bias expanded", "delta_bias sliced"])
def test_scan_backward_reads_strided_D_and_delta_bias(which):
    u, delta, z, dy, A, B, C = _scan_inputs()
    d = u.shape[1]
    D = torch.randn(2 * d)[::2] if which == "D sliced" else (
        torch.tensor(0.7).expand(d) if which == "D expanded" else torch.randn(d))
    bias = torch.tensor(0.3).expand(d) if which == "delta_bias expanded" else (
        torch.randn(2 * d)[::2] if which == "delta_bias sliced" else None)
    assert not (D.is_contiguous() and (bias is None or bias.is_contiguous()))
    args = (dy, None, u, delta, A, B, C, D, z, bias, True, None)
    want = cpu.selective_scan_bwd(*args)
    got = triton_bwd.selective_scan_bwd(*_dev(*args[:10]), True, None)
    for name in ("du", "ddelta", "dz", "dA", "dB", "dC", "dD", "ddelta_bias"):
        w, g_ = getattr(want, name), getattr(got, name)
        if w is None:
            continue
        torch.testing.assert_close(g_.cpu(), w, rtol=1e-4, atol=1e-5, msg=f"{which}: {name}")


@pytest.mark.parametrize("L", [7, 8, 17])
def test_scan_forward_last_state_with_infinite_decay_rate(L):
    u, delta, z, _, A, B, C = _scan_inputs(L=L, N=2)
    A[0, 1] = -float("inf")
    args = (u, delta, A, B, C, None, z, None, True, None, True)
    y_want, last_want = cpu.selective_scan_fwd(*args)
    y, last = triton_fwd.selective_scan_fwd(*_dev(*args[:8]), True, None, True)
    assert torch.isfinite(last_want).all()
    torch.testing.assert_close(last.cpu(), last_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.cpu(), y_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["column", "serial", "nblock"])
def test_infinite_decay_rate_meets_a_zero_dt(variant):
    # A = -inf meeting dt = 0 exactly (softplus(-120)) at t = 0: the first step is the identity
    # on every path, so the first state is dt * B * u = 0 as an associative_scan's is, and nothing
    # is NaN. Before (probe CI, run 61) the CPU path and the Triton backward formed exp(0 * -inf) =
    # NaN, which ran down the channel. Mid-sequence the CPU path keeps eager's NaN (below); the
    # kernels' finite stand-in for -inf makes that step the identity (finite_decay_rate's comment).
    u, delta, z, dy, A, B, C = _scan_inputs(L=40, N=4, seed=1)
    delta[:, :, 0] = -120.0
    A[0, 0] = -float("inf")
    D, bias = torch.randn(u.shape[1]), torch.randn(u.shape[1]) * 0.1
    args = (u, delta, A, B, C, D, z, bias, True, None, True)
    y_want, last_want = cpu.selective_scan_fwd(*args)
    assert torch.isfinite(y_want).all() and torch.isfinite(last_want).all()
    # dt = 0 at step 17 as well: exp(0 * -inf) = NaN in eager's loop and associative_scan alike, so
    # channel 0 is NaN from there on (probe CN, run 62: it was silently finite), the rest unchanged.
    mid = delta.clone()
    mid[:, :, 17] = -120.0
    y_mid, _ = cpu.selective_scan_fwd(u, mid, A, B, C, D, z, bias, True, None, True)
    assert y_mid[:, 0, 17:].isnan().all() and y_mid[:, 0, :17].isfinite().all() and y_mid[:, 1:].isfinite().all()
    torch.testing.assert_close(y_mid[:, 0, :17], y_want[:, 0, :17])
    y, last = triton_fwd.selective_scan_fwd(*_dev(*args[:8]), True, None, True)
    torch.testing.assert_close(y.cpu(), y_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last.cpu(), last_want, rtol=1e-5, atol=1e-6)
    # The fused kernel, with an identity conv (taps (0, 1), no activation) so that x is u.
    conv_w = torch.tensor([[0.0, 1.0]]).expand(u.shape[1], 2).contiguous()
    fused = fused_scan_fwd(*_dev(u, delta, A, B, C, D, z, bias), True, *_dev(conv_w), None, False, None).y
    torch.testing.assert_close(fused.cpu(), y_want, rtol=1e-5, atol=1e-5)
    # The gradients, with dt = 0 at t = 0 only, the case eager defines (an associative_scan's first
    # step). Not ddelta and ddelta_bias: eager's is NaN wherever A = -inf (-inf * exp(dt * A) = -inf
    # * 0), and the kernels' a_t * h_{t-1}, recovered as h_t - b_t (NOTES_scan_bwd.md, run 42),
    # leaves rounding noise times A = -3.4e38 there on the GPU (-2.5e30 against the CPU path's
    # -1.07, H100, run 61; benchmarks/repros/inf_decay_zero_dt_bwd.py).
    bwd = (dy, None, u, delta, A, B, C, D, z, bias, True, None)
    want = cpu.selective_scan_bwd(*bwd)
    got = triton_bwd.selective_scan_bwd(*_dev(*bwd[:10]), True, None, tiles={"variant": variant})
    for name in ("du", "dz", "dA", "dB", "dC", "dD"):
        w = getattr(want, name)
        assert torch.isfinite(w).all(), name
        torch.testing.assert_close(getattr(got, name).cpu(), w, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("variant", ["column", "serial", "nblock"])
def test_scan_backward_with_a_positive_infinite_decay_rate(variant):
    # A = +inf (probe CL, run 61): the padded steps' dt = 0 formed exp2(0 * inf) = NaN in the
    # backward's adjoint, and du, dB came back NaN at the last real step where the CPU path is finite.
    u, delta, z, dy, A, B, C = _scan_inputs(L=12, N=4)
    A[0, 0] = float("inf")
    D, bias = torch.randn(u.shape[1]), torch.randn(u.shape[1]) * 0.1
    bwd = (dy, None, u, delta, A, B, C, D, z, bias, True, None)
    want = cpu.selective_scan_bwd(*bwd)
    got = triton_bwd.selective_scan_bwd(*_dev(*bwd[:10]), True, None, tiles={"variant": variant})
    for name in ("du", "dB", "dC", "dz"):
        w, t = getattr(want, name), getattr(got, name).cpu()
        assert torch.equal(w.isfinite(), t.isfinite()), name
        torch.testing.assert_close(t[w.isfinite()], w[w.isfinite()], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("N", [3, 4, 5])
@pytest.mark.parametrize("inf", [float("inf"), -float("inf")])
def test_infinite_input_stays_infinite_with_padded_state_lanes(N, inf):
    # One channel, B = C = 1, A < 0: y_t = sum_n h_t[n], and an infinite u_0 makes every
    # h_t[n] infinite with u_0's sign (every decay is positive).
    u = torch.tensor([[[inf, 1.0, 2.0]]])
    delta = torch.full((1, 1, 3), 0.5)
    A, B, C = -torch.ones(1, N), torch.ones(1, 1, N, 3), torch.ones(1, 1, N, 3)
    args = (u, delta, A, B, C, None, None, None, False, None, False)
    want = cpu.selective_scan_fwd(*args)[0]
    assert (want == inf).all()
    y = triton_fwd.selective_scan_fwd(*_dev(*args[:8]), False, None, False)[0]
    assert torch.equal(y.cpu(), want)


@pytest.mark.parametrize("N", [3, 4])
def test_infinite_delta_stays_infinite_in_the_fused_kernel(N):
    # The fused kernel (conv, dt projection and scan in one launch) reads the state lanes the
    # same way. The conv is the identity (width 2, taps (0, 1), no activation), so x is u; the
    # last step's dt = inf decays the state to 0 and adds inf * u * B: y ends in +inf.
    u = torch.tensor([[[0.5, 1.0, 2.0]]])
    delta = torch.tensor([[[0.5, 0.5, float("inf")]]])
    A, B, C = -torch.ones(1, N), torch.ones(1, 1, N, 3), torch.ones(1, 1, N, 3)
    want = cpu.selective_scan_fwd(u, delta, A, B, C, None, None, None, False, None, False)[0]
    assert want[0, 0, 2] == float("inf") and torch.isfinite(want[0, 0, :2]).all()
    conv_w = torch.tensor([[0.0, 1.0]])
    fused = fused_scan_fwd(*_dev(u, delta, A, B, C), None, None, None, False,
                           *_dev(conv_w), None, False, None).y
    torch.testing.assert_close(fused.cpu(), want)


def test_scan_backward_with_no_channels():
    u, delta, z, dy, A, B, C = _scan_inputs(d=0)
    D, bias, h0 = torch.randn(0), torch.randn(0), torch.randn(2, 0, 3)
    args = (dy, torch.randn(2, 0, 3), u, delta, A, B, C, D, z, bias, True, h0)
    got = triton_bwd.selective_scan_bwd(*_dev(*args[:10]), True, *_dev(h0))
    want = cpu.selective_scan_bwd(*args)
    assert got.du.shape == u.shape and got.dinitial_state.shape == h0.shape
    # B and C feed no channel: their gradients are zeros of their shape, not uninitialised memory.
    assert torch.equal(got.dB.cpu(), torch.zeros_like(B)) and torch.equal(got.dC.cpu(), torch.zeros_like(C))
    torch.testing.assert_close(got.dB.cpu(), want.dB)
    assert got.dD.shape == (0,) and got.ddelta_bias.shape == (0,)


def test_conv_update_with_no_channels_on_cpu():
    x, state, w = torch.randn(2, 0, 3), torch.randn(2, 0, 5), torch.randn(0, 4)
    y = decode_op._conv_update_impl(x, state, w, None, "silu")
    assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("layout", ["expanded", "overlapping strides"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_decode_states_with_shared_elements_are_refused(layout, device):
    b, d, N, W = 3, 4, 2, 4
    if layout == "expanded":
        state = torch.randn(1, d, N, device=device).expand(b, -1, -1)
        conv_state = torch.randn(1, d, W - 1, device=device).expand(b, -1, -1)
    else:
        # Rows one element apart: row i's element j is row i + 1's element j - 1.
        state = torch.randn(64, device=device).as_strided((b, d, N), (1, N, 1))
        conv_state = torch.randn(64, device=device).as_strided((b, d, W - 1), (1, W - 1, 1))
    x, dt, z = (torch.randn(b, d, device=device) for _ in range(3))
    A = -torch.rand(d, N, device=device)
    Bm, Cm = (torch.randn(b, N, device=device) for _ in range(2))
    before, conv_before = state.clone(), conv_state.clone()
    with pytest.raises(ValueError, match="^ssm::selective_state_update: state must not have elements that share memory"):
        decode_op._state_update_impl(state, x, dt, A, Bm, Cm, None, z, None, True)
    with pytest.raises(ValueError, match="^ssm::causal_conv1d_update: conv_state must not have elements that share memory"):
        decode_op._conv_update_impl(x, conv_state, torch.randn(d, W, device=device), None, "silu")
    assert torch.equal(state, before) and torch.equal(conv_state, conv_before)


def test_decode_states_that_are_strided_views_of_a_cache_still_run():
    # The shared-memory check must not refuse the views people make of a cache.
    b, d, N = 3, 4, 2
    cache = torch.randn(2, b, d, 2 * N)
    for state in (cache[1, :, :, :N], cache[0, :, :, ::2], cache[1].transpose(0, 1).transpose(0, 1)[..., 1::2]):
        want_state = state.clone()
        x, dt, z = (torch.randn(b, d) for _ in range(3))
        A, Bm, Cm = -torch.rand(d, N), torch.randn(b, N), torch.randn(b, N)
        y_want = decode_op._state_update_impl(want_state, x, dt, A, Bm, Cm, None, z, None, True)
        y = decode_op._state_update_impl(state, x, dt, A, Bm, Cm, None, z, None, True)
        torch.testing.assert_close(y, y_want)
        torch.testing.assert_close(state, want_state)
