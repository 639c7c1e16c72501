"""HF Mamba with a module full-backward hook on mixer.x_proj: dynamo graph-breaks around the
x_proj call (module backward hooks need compiled autograd), and the resumed graph holds the whole
scan (split of x_proj output -> dt_proj -> softplus -> discretization -> associative_scan ->
readout / D skip / gate), yet the ssm backend rewrites nothing there: explain reports
  [discretization] B_full: a factor has an axis that is not one of (batch, dim, time, state)
Only conv1d (in the graph before the break) is rewritten. Results stay correct (grads match eager).
The hand-written mamba-minimal block in the same situation keeps its scan rewrite."""
import sys as _s; _s.path[:] = [p for p in _s.path if p != "/tmp/snap2"]
import transformers
from transformers import MambaConfig, MambaForCausalLM
import sys; pass  # against the installed package
import torch, ssm_compile
for hidden, B, L in [(32, 2, 16), (64, 3, 12)]:
    torch.manual_seed(0)
    m = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=hidden, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4, use_cache=False))
    ids = torch.randint(0, 64, (B, L))
    print(f"hidden={hidden} B={B} L={L} no hook:", ssm_compile.explain(m, ids, labels=ids).summary())
    m.backbone.layers[0].mixer.x_proj.register_full_backward_hook(lambda mod, gi, go: None)
    r = ssm_compile.explain(m, ids, labels=ids)
    print(f"hidden={hidden} B={B} L={L} bwd hook on x_proj:", r.summary())
    for x in r.misses: print("   miss:", x.family, x.reason[:150])
