"""The pre-rewrites transformers 5.25's Mamba needs, on code written without transformers.

- ``passes/pieces.py``: a split piece that is all of its input, ``tensor_split(x, [L], 2)[0]``, is
  read as x (so x_dt_proj still finds dt_proj behind Δ), and ``cat([x])`` as x (no copy of the
  scan output); a piece that is part of x, or a cat whose input someone else reads or writes, is
  left as it is.
- ``passes/inplace.py``'s staging clones: ``n = S.clone(); ...; n.copy_(v); S.copy_(n)`` is the
  decode step's ``S.copy_(v)``, so the state update is rewritten; when a reader could tell the
  two apart (it reads n after the write, or S between the copies) nothing changes.

Values are checked against eager on random inputs in every case, refusals included.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from utils import TOL, PassCapture, rel_err

from ssm_compile.compiler import backend
from ssm_compile.kernels.decode import op as decode_op
from ssm_compile.passes import decode
from ssm_compile.passes.inplace import rewrite_local_writes
from ssm_compile.passes.pieces import read_single_cats, read_whole_pieces
from ssm_compile.report import explain

B_, DIM, L, N, R = 2, 8, 7, 4, 3


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def capture(fn, *args, rewrite):
    seen = {}

    def be(gm, example_inputs):
        seen["changes"] = rewrite(gm)
        seen["gm"] = gm
        gm.recompile()
        return gm.forward

    out = torch.compile(fn, backend=be, fullgraph=True)(*args)
    torch._dynamo.reset()
    return seen["changes"], seen["gm"], out


# --- whole pieces ------------------------------------------------------------------------------

class SplitBlock(torch.nn.Module):
    """A Mamba-1 mixer whose scan inputs each pass through ``tensor_split(·, [L - keep], dim)[0]``,
    as transformers 5.25's ``mamba_scan_forward`` does (keep = the states a cache records)."""

    def __init__(self, keep=0):
        super().__init__()
        torch.manual_seed(0)
        self.keep = keep
        self.x_proj = torch.nn.Linear(DIM, R + 2 * N, bias=False)
        self.dt_proj = torch.nn.Linear(R, DIM)
        self.A_log = torch.nn.Parameter(torch.rand(DIM, N).log())
        self.D = torch.nn.Parameter(torch.randn(DIM))

    def forward(self, u):                                     # u: (b, dim, L)
        x_dbl = self.x_proj(u.transpose(1, 2))
        dt, B, C = torch.split(x_dbl, [R, N, N], dim=-1)
        dt = self.dt_proj.weight @ dt.transpose(1, 2)         # (b, dim, L), HF's spelling
        cut = u.shape[2] - self.keep
        u, _ = torch.tensor_split(u, [cut], dim=2)
        dt, _ = torch.tensor_split(dt, [cut], dim=2)
        B, _ = torch.tensor_split(B, [cut], dim=1)
        C, _ = torch.tensor_split(C, [cut], dim=1)
        delta = F.softplus(dt + self.dt_proj.bias[:, None])
        A = -torch.exp(self.A_log)
        dA = torch.exp(delta[..., None] * A[:, None, :])      # (b, dim, l, N)
        dBu = delta[..., None] * B[:, None] * u[..., None]
        h = u.new_zeros(u.shape[0], DIM, N)
        ys = []
        for t in range(u.shape[2]):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append((h * C[:, None, t]).sum(-1))
        y = torch.stack(ys, dim=-1) + u * self.D[:, None]
        return torch.cat([y], dim=2)


def test_whole_pieces_are_read_as_their_input_and_x_dt_proj_is_found():
    block, u = SplitBlock(), rand(B_, DIM, L, seed=1)
    report = explain(block, u)
    families = sorted(r.family for r in report.rewrites)
    assert families == ["delta", "discretization", "readout", "scan_loop", "skip", "x_dt_proj"], report.misses
    assert rel_err(report.output, block(u)) <= TOL[torch.float32]
    # No copy of the output is left for the cat (nor a split for the pieces).
    code = "\n".join(g.after for g in report.graphs)
    assert "cat(" not in code and "tensor_split" not in code


def test_a_piece_that_is_part_of_its_input_stays():
    # keep=2: the scan reads the first L-2 steps; reading all of u would be wrong.
    block, u = SplitBlock(keep=2), rand(B_, DIM, L, seed=2)
    changes, gm, out = capture(block, u, rewrite=read_whole_pieces)
    assert changes == []
    assert sum(n.target is torch.tensor_split for n in gm.graph.nodes) == 4
    torch.testing.assert_close(out, block(u), rtol=0, atol=0)


def whole_piece_written(x, y):
    piece = torch.tensor_split(x, [x.shape[1]], dim=1)[0]
    piece.mul_(2.0)               # writes x through the piece: the same elements either way
    return x + y, piece * 3.0


def test_a_whole_piece_written_in_place_writes_its_input():
    x, y = rand(3, 5, seed=3), rand(3, 5, seed=4)
    xe = x.clone()
    changes, gm, out = capture(whole_piece_written, x, y, rewrite=read_whole_pieces)
    assert len(changes) == 1
    ref = whole_piece_written(xe, y)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    torch.testing.assert_close(x, xe, rtol=0, atol=0)


def strided_piece(x):
    # chunk(1) of a transposed tensor: all of it, same strides.
    (piece,) = x.t().chunk(1, dim=0)
    return piece.sin()


def test_chunk_of_one_is_its_input():
    x = rand(4, 6, seed=5)
    changes, gm, out = capture(strided_piece, x, rewrite=read_whole_pieces)
    assert len(changes) == 1 and not any(n.op == "call_method" and n.target == "chunk" for n in gm.graph.nodes)
    torch.testing.assert_close(out, strided_piece(x), rtol=0, atol=0)


# --- cats of one tensor ------------------------------------------------------------------------

def cat_then_read(x):
    y = x.exp()
    return torch.cat([y], dim=1).sum(-1)


def cat_of_an_input(x):
    c = torch.cat([x], dim=0)
    c.add_(1.0)                   # must not write the caller's x
    return c


def cat_of_a_value_read_elsewhere(x):
    y = x.exp()
    c = torch.cat([y], dim=1)
    c.mul_(2.0)                   # y must keep its values for the line below
    return c + y


def cat_then_written(x):
    y = x.exp()
    c = torch.cat([y], dim=1)
    c[:, 0] = 0.0
    return c


def cat_of_a_transposed_value(x):
    y = x.exp().t()
    return torch.cat([y], dim=0).view(-1)   # the cat is contiguous; y's view would fail


@pytest.mark.parametrize("fn, folded", [
    (cat_then_read, True),
    (cat_of_an_input, False),
    (cat_of_a_value_read_elsewhere, False),
    (cat_then_written, False),
    (cat_of_a_transposed_value, False),
], ids=["read", "input", "value-read-elsewhere", "written", "other-strides"])
def test_single_cats(fn, folded):
    x = rand(3, 4, seed=6)
    xe, xc = x.clone(), x.clone()
    changes, gm, out = capture(fn, xc, rewrite=read_single_cats)
    assert bool(changes) == folded, changes
    assert any(n.op == "call_function" and n.target is torch.cat for n in gm.graph.nodes) != folded
    torch.testing.assert_close(out, fn(xe), rtol=0, atol=0)
    torch.testing.assert_close(xc, xe, rtol=0, atol=0)


def scan_then_cat(u, delta, A, B, C):
    """The loop's outputs stacked time-major, so y is (b, dim, L) through a transpose: the cat's
    contiguous copy has other strides than y (it cannot go before the rewrites), and the
    ``.view`` after it needs the strides it gets."""
    dA = torch.exp(delta[..., None] * A[:, None])              # (b, dim, L, N)
    dBu = delta[..., None] * B[:, None] * u[..., None]
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * C[:, None, t]).sum(-1))
    y = torch.stack(ys, dim=1).transpose(1, 2)
    return torch.cat([y], dim=2).view(u.shape[0], -1)


def test_cat_of_a_scan_output_goes_after_the_rewrites():
    u, delta = rand(B_, DIM, L, seed=8), F.softplus(rand(B_, DIM, L, seed=9))
    A, Bm, C = -torch.rand(DIM, N) - 0.1, rand(B_, L, N, seed=10), rand(B_, L, N, seed=11)
    report = explain(scan_then_cat, u, delta, A, Bm, C)
    assert "scan_loop" in [r.family for r in report.rewrites], report.misses
    code = "\n".join(g.after for g in report.graphs)
    assert "cat(" not in code, code
    assert rel_err(report.output, scan_then_cat(u, delta, A, Bm, C)) <= TOL[torch.float32]


# --- staging clones in a decode step ----------------------------------------------------------

@pytest.fixture
def step_inputs():
    decode_op.register()
    g = torch.Generator().manual_seed(7)
    return dict(state=torch.randn(B_, DIM, N, generator=g), x=torch.randn(B_, DIM, generator=g),
                dt=torch.randn(B_, DIM, generator=g), A=-torch.rand(DIM, N, generator=g) - 0.1,
                B=torch.randn(B_, N, generator=g), C=torch.randn(B_, N, generator=g),
                D=torch.randn(DIM, generator=g), z=torch.randn(B_, DIM, generator=g),
                dt_bias=torch.randn(DIM, generator=g))


def _update(state, x, dt, A, B, dt_bias):
    dt = F.softplus(dt + dt_bias)
    return state * torch.exp(dt[..., None] * A) + dt[..., None] * B[:, None] * x[..., None]


def staged(state, x, dt, A, B, C, D, z, dt_bias):
    """transformers 5.25's decode step: the new state is built in a clone and copied back."""
    nxt = state.clone()
    new = _update(nxt.float(), x, dt, A, B, dt_bias)
    nxt.copy_(new)
    y = (new @ C[..., None]).squeeze(-1) + x * D
    y = y * F.silu(z)
    state.copy_(nxt)
    return y


def staged_read_after_write(state, x, dt, A, B, C, D, z, dt_bias):
    """Reads the clone after its write: it sees the new state, which S would only hold later."""
    nxt = state.clone()
    new = _update(nxt, x, dt, A, B, dt_bias)
    nxt.copy_(new)
    y = (nxt @ C[..., None]).squeeze(-1) + (state * 0.5).sum(-1)
    state.copy_(nxt)
    return y


def staged_read_between_copies(state, x, dt, A, B, C, D, z, dt_bias):
    """Reads S between the two copies: the old state, which writing S early would overwrite."""
    nxt = state.clone()
    nxt.copy_(_update(nxt, x, dt, A, B, dt_bias))
    old = state.sum(-1)
    state.copy_(nxt)
    return (state @ C[..., None]).squeeze(-1) + old


def staged_from_the_state_itself(state, x, dt, A, B, C, D, z, dt_bias):
    """The staged value is a view of S: written to S directly it would overlap its own source."""
    nxt = state.clone()
    y = (nxt @ C[..., None]).squeeze(-1)
    nxt.copy_(state[:, :1].expand_as(state))
    state.copy_(nxt)
    return y


@pytest.mark.parametrize("fn, rewritten", [
    (staged, True), (staged_read_after_write, False), (staged_read_between_copies, False),
    (staged_from_the_state_itself, False),
], ids=["staged", "clone-read-after-write", "state-read-between-copies", "staged-view-of-the-state"])
def test_staged_state_update(fn, rewritten, step_inputs):
    eager_in = {k: v.clone() for k, v in step_inputs.items()}
    comp_in = {k: v.clone() for k, v in step_inputs.items()}
    ref = fn(**eager_in)
    cap = PassCapture(decode)
    out = torch.compile(fn, backend=cap, fullgraph=True)(**comp_in)
    assert (counters["ssm"]["state_update"] == 1) == rewritten, cap.ctx.misses
    clones = [n for n in cap.gm.graph.nodes if n.op == "call_method" and n.target == "clone"]
    assert bool(clones) != rewritten
    assert rel_err(out, ref) <= TOL[torch.float32]
    assert rel_err(comp_in["state"], eager_in["state"]) <= TOL[torch.float32]


def test_staged_step_under_inductor(step_inputs):
    eager_in = {k: v.clone() for k, v in step_inputs.items()}
    comp_in = {k: v.clone() for k, v in step_inputs.items()}
    ref = staged(**eager_in)
    out = torch.compile(staged, backend=backend(), fullgraph=True)(**comp_in)
    assert counters["ssm"]["state_update"] == 1, dict(counters["ssm"])
    assert rel_err(out, ref) <= TOL[torch.float32]
    assert rel_err(comp_in["state"], eager_in["state"]) <= TOL[torch.float32]


def test_staging_clone_rewrite_alone(step_inputs):
    changes, gm, _ = capture(staged, *[v.clone() for v in step_inputs.values()], rewrite=rewrite_local_writes)
    assert len(changes) == 1 and "copied back" in changes[0], changes
    copies = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "copy_"]
    assert len(copies) == 1 and copies[0].args[0].op == "placeholder"


# --- what an adversarial probe found (run 36): each compiled result must be eager's -----------

def _eager_and_compiled(fn, make):
    """``fn`` eagerly and compiled (all passes, no inductor) on fresh copies of ``make()``'s
    inputs; returns ((inputs, out) eager, (inputs, out) compiled)."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        args = make()
        f = torch.compile(fn, backend=backend(inductor=False), fullgraph=True) if compiled else fn
        runs.append((args, f(*args)))
    return runs


def _grad_inputs(*shapes, seed=12):
    def make():
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(*s, generator=g, requires_grad=True) for s in shapes]
    return make


def piece_under_no_grad(x, w):
    y = x * 2
    with torch.no_grad():
        p = y.chunk(1)[0]           # no history: x gets no gradient through p
    return p * w + x.sum()


def cat_under_no_grad(x, w):
    y = x * 2
    with torch.no_grad():
        c = torch.cat([y], 0)
    return c * w + x.sum()


def staging_clone_under_no_grad(x, v, w):
    S = x * 2
    with torch.no_grad():
        n = S.clone()
    a = n + w
    n.copy_(v)
    S.copy_(n)
    return a + x.sum()


def clone_under_no_grad(x, w):
    with torch.no_grad():
        c = x.clone()
    return c + w + x.sum()


@pytest.mark.parametrize("fn, nin", [(piece_under_no_grad, 2), (cat_under_no_grad, 2),
                                     (staging_clone_under_no_grad, 3), (clone_under_no_grad, 2)],
                         ids=["piece", "cat", "staging-clone", "guard-clone"])
def test_views_and_copies_made_under_no_grad_keep_their_gradients(fn, nin):
    (e_in, e_out), (c_in, c_out) = _eager_and_compiled(fn, _grad_inputs(*[(4, 5)] * nin))
    torch.testing.assert_close(c_out, e_out, rtol=0, atol=0)
    e_out.sum().backward()
    c_out.sum().backward()
    for a, b in zip(c_in, e_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def returned_pieces(x):
    y = x * 2
    return x.chunk(1)[0], y, torch.split(y, [4, 0])[0]


def test_a_returned_piece_stays_its_own_tensor():
    # Read as x, the returned piece would be x's own tensor object: changing its shape in place
    # (which a caller may do) would change x's too.
    (e_in, e_out), (c_in, c_out) = _eager_and_compiled(returned_pieces, lambda: [rand(4, 5, seed=13)])
    assert c_out[0] is not c_in[0] and c_out[2] is not c_out[1]
    c_out[0].unsqueeze_(0)
    c_out[2].t_()
    assert c_in[0].shape == (4, 5) and c_out[1].shape == (4, 5)


def piece_read_after_its_source_is_transposed(x, m):
    y = x * 2
    p = y.chunk(1)[0]
    y.t_()
    r = p @ m                       # p keeps y's layout from before the t_()
    y.t_()
    return r


def cat_of_a_view(x):
    z = x * 2
    c = torch.cat([z[1]])
    return c.as_strided((5,), (1,), 0)  # the cat's own memory from offset 0, not z's


@pytest.mark.parametrize("fn, make", [
    (piece_read_after_its_source_is_transposed, lambda: [rand(4, 4, seed=14), rand(4, 4, seed=15)]),
    (cat_of_a_view, lambda: [rand(3, 5, seed=16)]),
], ids=["piece-metadata-mutated", "cat-of-a-view"])
def test_pieces_and_cats_whose_memory_or_metadata_differ(fn, make):
    (_, e_out), (_, c_out) = _eager_and_compiled(fn, make)
    torch.testing.assert_close(c_out, e_out, rtol=0, atol=0)
