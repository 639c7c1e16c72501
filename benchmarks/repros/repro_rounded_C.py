# fp32 scan loop whose readout uses a rounded C (C.bfloat16().float(), or C.half() promoted against the fp32
# state): scan_loop hands ssm.selective_scan the *unrounded* C (it looks through the casts on C and its
# dropped_rounding check only covers the replaced loop/discretisation nodes), so the answer changes.
# The same rounding on B, u, A or delta is refused with a reason; under associative_scan C's rounding is refused too.
import transformers  # noqa
import sys; pass  # against the installed package
import torch, ssm_compile
import torch.nn.functional as F
torch.manual_seed(0)
b, d, n, l = 2, 6, 4, 7

def make(round_C):
    def f(u, delta, A, B, C):
        Cq = round_C(C)
        dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])
        dBu = (delta * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)
        h = torch.zeros(b, d, n)
        ys = []
        for t in range(l):
            h = dA[:, :, t] * h + dBu[:, :, t]
            ys.append((h * Cq[:, None, :, t]).sum(-1))
        return torch.stack(ys, -1)
    return f

args = (torch.randn(b, d, l), F.softplus(torch.randn(b, d, l)), -torch.rand(d, n) - 0.1, torch.randn(b, n, l), torch.randn(b, n, l))
for name, rc in [("C.bfloat16().float()", lambda C: C.bfloat16().float()), ("C.half() (promoted)", lambda C: C.half())]:
    f = make(rc)
    ref = f(*args)
    rep = ssm_compile.explain(f, *args)
    torch._dynamo.reset()
    out = torch.compile(f, backend=ssm_compile.backend())(*args)
    unrounded = make(lambda C: C)(*args)
    print(name, "|", rep.summary())
    print("  compiled vs eager max rel err:", ((out - ref).abs().max() / ref.abs().max()).item())
    print("  compiled vs eager-with-unrounded-C:", ((out - unrounded).abs().max() / ref.abs().max()).item())
    torch._dynamo.reset()
