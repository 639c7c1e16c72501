"""Inductor and a mutating custom op whose written argument is a view with a storage offset.

A minimal custom op (``state.mul_(0.5).add_(x)``, schema ``Tensor(a!)``) is called on
``cache[1]`` of a stacked (layers, batch, dim, N) tensor, directly or on a clone of it, and on
its functional twin followed by ``copy_`` (what ``passes/decode.py`` emits for such a state).
Each is compiled with inductor, static and dynamic, on every device present, over two batch sizes;
"ok" means outputs and the whole cache equal eager's. Torch 2.13 on the CPU (session 5 of
2026-12-04): the direct write fails under dynamic shapes, the clone form fails under both, the
functional form passes. Run: ``python benchmarks/repros/repro_inductor_view_mutation.py``.
"""
import torch


@torch.library.custom_op("repro::upd", mutates_args=("state",))
def upd(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    state.mul_(0.5).add_(x[..., None])
    return state.sum(-1)


@upd.register_fake
def _(state, x):
    return x.new_empty(x.shape)


@torch.library.custom_op("repro::upd_functional", mutates_args=())
def upd_functional(state: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    new = state * 0.5 + x[..., None]
    return new.sum(-1), new


@upd_functional.register_fake
def _(state, x):
    return x.new_empty(x.shape), state.new_empty(state.shape)


def direct(cache, x):
    return torch.ops.repro.upd(cache[1], x)


def on_clone(cache, x):
    s = cache[1]
    t = s.clone()
    y = torch.ops.repro.upd(t, x)
    s.copy_(t)
    return y


def functional(cache, x):
    s = cache[1]
    y, new = torch.ops.repro.upd_functional(s, x)
    s.copy_(new)
    return y


def main():
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}")
    for device in devices:
        for fn in (direct, on_clone, functional):
            for dynamic in (False, True):
                torch._dynamo.reset()
                compiled = torch.compile(fn, dynamic=dynamic)
                ok = []
                for batch in (2, 3):
                    cache, x = torch.randn(3, batch, 6, 4, device=device), torch.randn(batch, 6, device=device)
                    c1, c2 = cache.clone(), cache.clone()
                    y1, y2 = fn(c1, x), compiled(c2, x)
                    ok.append(bool(torch.allclose(y1, y2) and torch.allclose(c1, c2)))
                print(f"{device:4s} {fn.__name__:10s} dynamic={dynamic!s:5s} ok per batch: {ok}")


if __name__ == "__main__":
    main()
