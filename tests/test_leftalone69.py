"""Items run 69 found left alone without a reason or with a needless copy.

- A bare ``squeeze()`` after the scan's readout that drops a size-1 axis of y other than its
  leading ones (one channel: dim = 1; zeta's ``(hs @ C.unsqueeze(-1)).squeeze()``): the skip and
  the gate after it were not looked at, and the skip's miss had no reason. Broadcasting puts
  size-1 axes back in front only, so no skip or gate after such a squeeze holds y's values in
  y's shape: each is left as written, with a reason that says what was squeezed. A squeeze of
  the leading axes alone (batch 1) still folds.

Values and gradients are compared with eager in fp64 on random inputs.
"""
import pytest
import torch
import torch.nn.functional as F
from utils import check_explained_against_fp64

from ssm_compile.report import explain

L, N = 5, 3


def seq_scan(x, delta, A, B, C, D=None, z=None, squeeze_terms=False):
    """zeta's ``selective_scan_seq`` (x (batch, L, dim)) with an optional skip and gate;
    ``squeeze_terms``: they read x and z squeezed as y is, so their result stays squeezed."""
    deltaA = torch.exp(delta.unsqueeze(-1) * A)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    h = torch.zeros(x.size(0), x.size(2), A.shape[1])
    hs = []
    for t in range(x.shape[1]):
        h = deltaA[:, t] * h + BX[:, t]
        hs.append(h)
    y = (torch.stack(hs, dim=1) @ C.unsqueeze(-1)).squeeze()
    if D is not None:
        y = y + D * (x.squeeze() if squeeze_terms else x)
    return y if z is None else y * F.silu(z.squeeze() if squeeze_terms else z)


def _inputs(batch, dim, skip, gate):
    g = torch.Generator().manual_seed(7)
    args = [torch.randn(batch, L, dim, generator=g), F.softplus(torch.randn(batch, L, dim, generator=g)),
            -(torch.rand(dim, N, generator=g) + 0.3), torch.randn(batch, L, N, generator=g),
            torch.randn(batch, L, N, generator=g)]
    args.append(torch.randn(dim, generator=g) if skip else None)
    args.append(torch.randn(batch, L, dim, generator=g) if gate else None)
    return args


@pytest.mark.parametrize("batch, dim, skip, gate, folded, family, reason", [
    # Batch 1: the squeeze drops the leading axis, and the skip and the gate broadcast it back.
    (1, 6, True, True, {"skip": 1, "gate": 1}, None, None),
    # One channel: the squeeze drops the dim axis, in the middle of (batch, L, 1).
    (2, 1, True, False, {}, "skip", "a squeeze() that drops y's size-1 axes [2] of [2, 5, 1], not only leading "
                                    "ones: broadcasting puts size-1 axes back in front only, so the skip's result "
                                    "[2, 5] cannot hold y's values"),
    (2, 1, False, True, {}, "gate", "a squeeze() that drops y's size-1 axes [2] of [2, 5, 1], not only leading "
                                    "ones: broadcasting puts size-1 axes back in front only, so the gate's result "
                                    "[2, 5] cannot hold y's values"),
    # Batch 1 and one channel: leading and trailing axes dropped.
    (1, 1, True, False, {}, "skip", "drops y's size-1 axes [0, 2] of [1, 5, 1], not only leading ones"),
], ids=["B1-folds", "D1-skip-says-why", "D1-gate-says-why", "B1-D1-skip-says-why"])
def test_tail_after_a_squeeze_of_y(batch, dim, skip, gate, folded, family, reason):
    *tensors, D, z = _inputs(batch, dim, skip, gate)
    args = [a.requires_grad_() for a in [*tensors, *(t for t in (D, z) if t is not None)]]

    def fn(*a):
        x, delta, A, B, C, *rest = a
        return seq_scan(x, delta, A, B, C, rest.pop(0) if skip else None, rest.pop(0) if gate else None,
                        squeeze_terms=family is not None)

    report = explain(fn, *args)
    assert report.counts["scan_loop"] == 1, report.format(graphs=False)
    assert {k: report.counts[k] for k in ("skip", "gate") if report.counts[k]} == folded, report.format(graphs=False)
    if reason is not None:
        assert any(reason in m.reason for m in report.misses if m.family == family), report.format(graphs=False)
    else:
        assert not [m for m in report.misses if m.family in ("skip", "gate")], report.format(graphs=False)
    check_explained_against_fp64(report, fn, args)
