"""In-place parallel scans as public Mamba code writes them, under dynamic shapes (probe CY, run 67).

mamba.py's PScan (alxndrTL/mamba.py ``pscan.py``: clone or zero-pad to the next power of two,
Blelloch sweeps on pair views) was rewritten on the first call only: at a second batch size the
copies' symbolic batch stopped the proof (and the reason named the batch as "the time length"),
and at a second length the symbolic pad amount left the copies unseen (no reason at all). The
Fleuret-style PScan of VMamba's and zeta's ``pscan.py`` was never rewritten: its down sweep's top
level makes empty views, which the proof took for views mixing axes. All run without grad, as
both PScans are custom ``autograd.Function``s whose backward is the user's (eager cannot
differentiate the in-place sweeps themselves), so only values are compared.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from test_pass_scan_inplace import _down, _mamba_py_pscan
from torch._dynamo.utils import counters
from utils import rel_err

from ssm_compile.compiler import SSMBackend, SSMOptions
from ssm_compile.passes import scan_assoc
from ssm_compile.passes.fx_utils import val

DIM, N = 3, 4


def make_inputs(batch, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, L, DIM, generator=g, dtype=torch.float64)
    delta = torch.rand(batch, L, DIM, generator=g, dtype=torch.float64) * 0.5 + 0.05
    A = -torch.rand(DIM, N, generator=g, dtype=torch.float64) - 0.5
    B = torch.randn(batch, L, N, generator=g, dtype=torch.float64)
    C = torch.randn(batch, L, N, generator=g, dtype=torch.float64)
    D = torch.randn(DIM, generator=g, dtype=torch.float64)
    return x, delta, A, B, C, D


def reference(x, delta, A, B, C, D, h0=None):
    """h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t from h0 (zero), read out by C, plus D x."""
    h = torch.zeros(x.shape[0], DIM, N, dtype=torch.float64) if h0 is None else h0
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, dim=1) + D * x


def npo2(n):
    return 2 ** math.ceil(math.log2(n))


def mambapy_block(x, delta, A, B, C, D, h0=None):
    """mamba.py's ``selective_scan`` with its ``PScan.forward`` inlined (as dynamo inlines it
    without grad), the H_0 path included: (B, L, D, N) inputs, copies transposed to (B, D, L, N)."""
    dA = torch.exp(delta.unsqueeze(-1) * A)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    L = x.size(1)
    if h0 is not None:
        BX = torch.cat([h0.unsqueeze(1), BX], dim=1)
        dA = torch.cat([torch.ones(x.size(0), 1, DIM, N, dtype=dA.dtype), dA], dim=1)
        L += 1
    if L == npo2(L):
        Ac, Xc = dA.clone(), BX.clone()
    else:
        Ac = F.pad(dA, (0, 0, 0, 0, 0, npo2(L) - L), "constant", 0)
        Xc = F.pad(BX, (0, 0, 0, 0, 0, npo2(L) - L), "constant", 0)
    Ac, Xc = Ac.transpose(2, 1), Xc.transpose(2, 1)
    _mamba_py_pscan(Ac, Xc)
    hs = Xc.transpose(2, 1)[:, 1:L] if h0 is not None else Xc.transpose(2, 1)[:, :L]
    return (hs @ C.unsqueeze(-1)).squeeze(3) + D * x


def _fleuret_pscan(A, X):
    """VMamba's ``classification/models/pscan.py`` (zeta's ``p_scan.py``) sweeps, in place on
    (B, D, L, N): any L, an odd tail fixed up; the down sweep starts at the top level, where
    ``Xa[:, :, 1:, 0]`` of one pair is empty."""
    Bs, Dd, L, _ = A.size()
    num_steps = int(math.log2(L))
    Aa, Xa = A, X
    for _ in range(num_steps):
        T = 2 * (Xa.size(2) // 2)
        Aa, Xa = Aa[:, :, :T].view(Bs, Dd, T // 2, 2, -1), Xa[:, :, :T].view(Bs, Dd, T // 2, 2, -1)
        Xa[:, :, :, 1].add_(Aa[:, :, :, 1].mul(Xa[:, :, :, 0]))
        Aa[:, :, :, 1].mul_(Aa[:, :, :, 0])
        Aa, Xa = Aa[:, :, :, 1], Xa[:, :, :, 1]
    for k in range(num_steps - 1, -1, -1):
        Aa, Xa = A[:, :, 2 ** k - 1:L:2 ** k], X[:, :, 2 ** k - 1:L:2 ** k]
        T = 2 * (Xa.size(2) // 2)
        if T < Xa.size(2):
            Xa[:, :, -1].add_(Aa[:, :, -1].mul(Xa[:, :, -2]))
            Aa[:, :, -1].mul_(Aa[:, :, -2])
        Aa, Xa = Aa[:, :, :T].view(Bs, Dd, T // 2, 2, -1), Xa[:, :, :T].view(Bs, Dd, T // 2, 2, -1)
        Xa[:, :, 1:, 0].add_(Aa[:, :, 1:, 0].mul(Xa[:, :, :-1, 1]))
        Aa[:, :, 1:, 0].mul_(Aa[:, :, :-1, 1])


def fleuret_block(x, delta, A, B, C, D):
    Ac = torch.exp(delta.unsqueeze(-1) * A).clone().transpose(2, 1)
    Xc = (delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)).clone().transpose(2, 1)
    _fleuret_pscan(Ac, Xc)
    return (Xc.transpose(2, 1) @ C.unsqueeze(-1)).squeeze(3) + D * x


def batch_sized_sweep(x, delta, A, B, C, D):
    """A first up-sweep level whose time slices start at batch - 2: the scan at batch 2 only."""
    Ac = torch.exp(delta.unsqueeze(-1) * A).clone().transpose(2, 1)
    Xc = (delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)).clone().transpose(2, 1)
    T, k = x.size(1), x.size(0) - 2
    Xc[:, :, 1 + k::2].add_(Ac[:, :, 1 + k::2] * Xc[:, :, k:-1:2])
    Ac[:, :, 1 + k::2].mul_(Ac[:, :, k:-1:2])
    s = 2
    while s < T:
        right, left = slice(2 * s - 1, T, 2 * s), slice(s - 1, T, 2 * s)
        Xc[:, :, right].add_(Ac[:, :, right] * Xc[:, :, left])
        Ac[:, :, right].mul_(Ac[:, :, left])
        s *= 2
    _down(Ac, Xc, T)
    return (Xc.transpose(2, 1) @ C.unsqueeze(-1)).squeeze(3) + D * x


class Recorder(SSMBackend):
    """The ssm backend without inductor, keeping each graph (with its placeholders' sizes)."""

    def __init__(self):
        self.records, self.graphs = [], []
        super().__init__(SSMOptions(inductor=False), on_graph=self.records.append)

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return super().__call__(gm, example_inputs)


def run(fn, shapes, dynamic=None, **kwargs):
    """Compile ``fn`` once and call it at each (batch, L); compare with eager (fp64) each time."""
    backend = Recorder()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    for batch, L in shapes:
        args = make_inputs(batch, L)
        with torch.no_grad():
            out = compiled(*args, **kwargs)
            assert rel_err(out, fn(*args, **kwargs)) <= 1e-12, (batch, L)
            if fn is not batch_sized_sweep:
                assert rel_err(out, reference(*args, **kwargs)) <= 1e-12, (batch, L)
    return backend


def scan_decisions(backend):
    return [[r.decision for r in g.rewrites if r.family == "scan_assoc"] for g in backend.records]


def scan_reasons(record):
    return [m.reason for m in record.misses if m.family == "scan_assoc"]


def x_sizes(gm):
    (x,) = [n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "L_x_"]
    return [str(s) for s in val(x).shape]


def test_mambapy_pscan_at_a_second_batch_size():
    """Batch 2 then 5 (a symbolic batch, taken at its traced value where every view walks it
    whole), then 7 in the same graph: rewritten each time (the second graph used to keep the
    sweeps, with a reason that called the batch symbol the time length)."""
    backend = run(mambapy_block, [(2, 4), (5, 4), (7, 4)])
    assert len(backend.records) == 2 and x_sizes(backend.graphs[1])[1] == "4"
    assert [len(d) for d in scan_decisions(backend)] == [1, 1], [scan_reasons(r) for r in backend.records]
    assert counters["ssm"]["discretization"] == counters["ssm"]["readout"] == 2


def test_mambapy_pscan_dynamic_batch_and_length():
    """``dynamic=True``: batch, L and the state size symbolic. L's range stays 2..int_oo while
    the guards pin npo2(L) == 4 and L != 4 (the clone branch): the scan is proved at L = 3, the
    one length this graph serves, at batch 2 and at batch 6. (L 5..7 would be proved at each
    of them the same way, but dynamo takes seconds more to trace the deeper sweeps.)"""
    backend = run(mambapy_block, [(2, 3), (6, 3)], dynamic=True)
    assert [[d["proved_lengths"] for d in g] for g in scan_decisions(backend)] == [[[3]]], \
        [scan_reasons(r) for r in backend.records]
    batch, length, _ = x_sizes(backend.graphs[0])
    assert not batch.isdigit() and not length.isdigit()


def pad8_block(x, delta, A, B, C, D):
    """The copies zero-padded to 8 steps whatever L (at most 8) is."""
    Ac = F.pad(torch.exp(delta.unsqueeze(-1) * A), (0, 0, 0, 0, 0, 8 - x.size(1))).transpose(2, 1)
    Xc = F.pad(delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1), (0, 0, 0, 0, 0, 8 - x.size(1))).transpose(2, 1)
    _mamba_py_pscan(Ac, Xc)
    return (Xc.transpose(2, 1)[:, :x.size(1)] @ C.unsqueeze(-1)).squeeze(3) + D * x


def test_unenumerated_length_reason_names_the_length(monkeypatch):
    """Where the pass will not enumerate the admitted lengths, the reason names L's symbol, not
    the batch's (the batch and L both symbolic; the copies' pad amount was not read before, and
    no reason given)."""
    monkeypatch.setattr(scan_assoc, "_MAX_LENGTHS", 0)
    backend = run(pad8_block, [(2, 5)], dynamic=True)
    assert counters["ssm"]["scan_assoc"] == 0
    batch, length, _ = x_sizes(backend.graphs[0])
    reasons = scan_reasons(backend.records[0])
    assert any(r.startswith(f"in-place parallel scan: the time length is symbolic: the time length {length} "
                            "ranges over ") for r in reasons), reasons
    assert not any(batch in r for r in reasons), reasons


def test_time_slice_sized_by_the_batch_is_left_alone():
    """A batch-dependent time slice picks other time positions at other batch sizes: the
    traced batch proves nothing there, and the reason says so."""
    backend = run(batch_sized_sweep, [(2, 4), (4, 4)])
    assert [len(d) for d in scan_decisions(backend)] == [1, 0]
    reasons = scan_reasons(backend.records[1])
    assert any("a symbolic size other than the time length, indexes or slices the scan's buffers" in r
               for r in reasons), reasons


@pytest.mark.parametrize("L", [6, 9])
def test_fleuret_pscan_with_empty_top_level_views(L):
    """An empty view reads and writes nothing: the sweeps are the scan, and are rewritten."""
    backend = run(fleuret_block, [(2, L)])
    assert counters["ssm"]["scan_assoc"] == 1, scan_reasons(backend.records[0])
    assert counters["ssm"]["discretization"] == counters["ssm"]["readout"] == 1


def test_mambapy_pscan_from_an_initial_state_names_it():
    """mamba.py's H_0 path scans from row 0 of its copies (H_0, and ones for the decay) and
    reads the states from row 1: left alone, with a reason that says so."""
    g = torch.Generator().manual_seed(1)
    h0 = torch.randn(2, DIM, N, generator=g, dtype=torch.float64)
    backend = run(mambapy_block, [(2, 6)], h0=h0)
    assert counters["ssm"]["scan_assoc"] == 0
    assert any("read from time 1 on: row 0 of its copies is an initial state" in r
               for r in scan_reasons(backend.records[0])), scan_reasons(backend.records[0])
