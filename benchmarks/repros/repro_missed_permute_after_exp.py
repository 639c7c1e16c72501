# Missed rewrites: real-world scans that permute / transpose / .contiguous() / .view() the discretised
# tensors AFTER exp(Δ·A) (e.g. to time-major for a Kogge-Stone or associative scan, or pscan's
# deltaA.transpose(1, 2)). The same code with the permute applied BEFORE exp is rewritten.
# Responsible: passes/discretize.py (match_discretization does not look through views of A_full/B_full),
# and scan_assoc's in-place prover ("states are not laid out as B_full").
# Run 40: the loop cases (permute / .contiguous() after exp) are rewritten now (discretize.py proves the
# exp under the permutation); the Kogge-Stone sweep and the 3-D flattened associative_scan are still missed.
import transformers  # noqa
import sys; pass  # against the installed package
import torch, ssm_compile
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan
torch.manual_seed(0)
b, d, n, l = 2, 6, 4, 8

def loop(a, x, C):   # a, x: (b, l, d, n)
    h = torch.zeros(b, d, n); ys = []
    for t in range(l):
        h = a[:, t] * h + x[:, t]
        ys.append(torch.einsum('bdn,bn->bd', h, C[:, :, t]))
    return torch.stack(ys, -1)

def permute_after_exp(u, delta, A, B, C):
    a = torch.exp(torch.einsum('bdl,dn->bdln', delta, A)).permute(0, 2, 1, 3)
    x = torch.einsum('bdl,bnl,bdl->bdln', delta, B, u).permute(0, 2, 1, 3)
    return loop(a, x, C)

def permute_before_exp(u, delta, A, B, C):   # control: rewritten
    a = torch.exp(torch.einsum('bdl,dn->bdln', delta, A).permute(0, 2, 1, 3))
    x = torch.einsum('bdl,bnl,bdl->bdln', delta, B, u).permute(0, 2, 1, 3)
    return loop(a, x, C)

def contiguous_after_exp(u, delta, A, B, C):
    a = torch.exp(torch.einsum('bdl,dn->bdln', delta, A)).contiguous().permute(0, 2, 1, 3)
    x = torch.einsum('bdl,bnl,bdl->bdln', delta, B, u).permute(0, 2, 1, 3)
    return loop(a, x, C)

def kogge_stone(u, delta, A, B, C):
    deltaA = torch.exp(torch.einsum('bdl,dn->bdln', delta, A))
    deltaB_u = torch.einsum('bdl,bnl,bdl->bdln', delta, B, u)
    a = deltaA.permute(2, 0, 1, 3).clone(); x = deltaB_u.permute(2, 0, 1, 3).clone()
    s = 1
    while s < l:
        x[s:] = a[s:] * x[:-s] + x[s:]
        a[s:] = a[s:] * a[:-s]
        s *= 2
    return torch.einsum('bdln,bnl->bdl', x.permute(1, 2, 0, 3), C)

def combine(p, q):
    return q[0] * p[0], q[0] * p[1] + q[1]

def assoc_time_major_flat(u, delta, A, B, C):
    deltaA = torch.exp(torch.einsum('bdl,dn->bdln', delta, A)).permute(2, 0, 1, 3).contiguous()
    deltaB_u = torch.einsum('bdl,bnl,bdl->bdln', delta, B, u).permute(2, 0, 1, 3).contiguous()
    _, hs = associative_scan(combine, (deltaA.view(l, -1, n), deltaB_u.view(l, -1, n)), dim=0, combine_mode="generic")
    hs = hs.view(l, b, d, n)
    return torch.einsum('lbdn,bnl->bdl', hs, C)

args = (torch.randn(b, d, l), F.softplus(torch.randn(b, d, l)), -torch.rand(d, n) - 0.1, torch.randn(b, n, l), torch.randn(b, n, l))
for f in (permute_before_exp, permute_after_exp, contiguous_after_exp, kogge_stone, assoc_time_major_flat):
    rep = ssm_compile.explain(f, *args)
    print(f"{f.__name__:24s}", dict(rep.counts), [m.reason[:110] for m in rep.misses])
