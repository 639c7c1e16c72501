"""torch.inference_mode() opened inside compiled code, with plain inductor (no ssm code).

Run 45's probe found that the ssm backend falls back to no rewrites for a Mamba block whose
forward runs under ``with torch.inference_mode():`` inside the compiled function (AOTAutograd:
"Cannot set version_counter for inference tensor"). The same error comes from plain inductor for
any view of a parameter taken inside such a region; the conv pass's weight view is one. This
script shows it without the backend: ``python benchmarks/repros/inference_mode_param_view.py``.
"""
import torch

weight = torch.nn.Parameter(torch.randn(4, 1, 3))


def param_view(x):
    with torch.inference_mode():
        return x * weight.squeeze(1).sum()


for fn in (param_view,):
    x = torch.randn(4, 3)
    try:
        out = torch.compile(fn, backend="inductor")(x)
        print(f"{fn.__name__}: ok, max abs diff from eager {(out - fn(x)).abs().max().item():.2e}")
    except Exception as exc:  # noqa: BLE001  (the point of the script is the error)
        lines = [line for line in str(exc).splitlines() if "Error" in line] or [str(exc)]
        print(f"{fn.__name__}: {type(exc).__name__}: {lines[0][:160]}")
