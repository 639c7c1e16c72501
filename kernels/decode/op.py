"""The decode ops ``ssm::selective_state_update`` and ``ssm::causal_conv1d_update`` (and
``ssm::round_through``, a rounding the decode rewrites keep).

Both update a cache tensor in place, and say so in their schema (``Tensor(a!)``), so that
functionalization turns the call into a functional op plus a copy back, and CUDA graphs capture
the write to the static cache buffer. They are inference-only: no autograd formula is
registered (PyTorch refuses one for a mutating op), so a backward through either raises
"no autograd formula was registered" instead of returning wrong gradients.

Each also has a functional twin (``selective_state_update_functional``,
``causal_conv1d_update_functional``) that leaves its state alone and returns the updated one.
The passes use the twins where the state is not a graph input itself (a view of a stacked
cache, or a step that returns its new state): inductor (torch 2.13) mis-addresses a mutating
custom op's write to a view with a storage offset under dynamic shapes, and to a clone of
such a view even with static ones (``tests/test_decode_views.py``), while a functional op
followed by ``copy_`` into the view is ordinary functionalization. For the same reason a graph
that calls the in-place op itself (user code compiled by plain inductor) is traced with the twin
and a copy back wherever the op is not inlined (``_state_update_functional_traced``).

One decode step runs these ops once per layer, so their host cost is per token. They are
defined on a ``torch.library.Library`` fragment (schema, CPU/CUDA kernels, fake kernel, and an
``Autograd`` kernel that only refuses differentiation) rather than with
``torch.library.custom_op``, whose per-call Python layers (autograd wrapper, version-bump
kernel, aliasing check, dynamo-disable wrapper) cost more than the kernels themselves at batch 1;
and the real kernels remember which input signatures already passed their checks
(``benchmarks/host_overhead_ops.py`` measures it).
"""
import functools

import torch
from torch import _C

from ..context import refuse_forward_ad, register_autograd, registration_guard, without_autocast
from ..inline import register_inline
from . import cpu

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# mamba_ssm and the causal-conv1d package accept "swish" as a synonym of silu, as ssm::causal_conv1d does.
_ACTIVATIONS = (None, "silu", "swish")
MAX_N = 256
MIN_W, MAX_W = 2, 8

_STATE_UPDATE_SCHEMA = (
    "selective_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
    "Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False) -> Tensor"
)
_CONV_UPDATE_SCHEMA = (
    "causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias=None, "
    "str? activation=None) -> Tensor"
)
_STATE_UPDATE_FUNCTIONAL_SCHEMA = (
    "selective_state_update_functional(Tensor state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
    "Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False) -> (Tensor, Tensor)"
)
_ROUND_THROUGH_SCHEMA = "round_through(Tensor x, ScalarType dtype) -> Tensor"
_CONV_UPDATE_FUNCTIONAL_SCHEMA = (
    "causal_conv1d_update_functional(Tensor x, Tensor conv_state, Tensor weight, Tensor? bias=None, "
    "str? activation=None) -> (Tensor, Tensor)"
)

# Input signatures (shapes, dtypes, devices, flags) that passed the checks below: validity
# depends on nothing else, and a lookup costs about half of a full check. Bounded so that a
# stream of ever-new shapes cannot grow it without limit.
_VALIDATED: set = set()
_MAX_VALIDATED = 4096


def _checked_once(check, *args) -> None:
    """Run ``check(*args)`` unless these real (never fake: SymInts are unhashable) arguments'
    signature already passed it."""
    key = tuple([check] + [(a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args])
    if key in _VALIDATED:
        return
    check(*args)
    if len(_VALIDATED) >= _MAX_VALIDATED:
        _VALIDATED.clear()
    _VALIDATED.add(key)


def _check_tensor(name, t, shape, dtypes, device):
    """``t`` has exactly ``shape``, one of ``dtypes`` and sits on ``device``, else an error naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (like state), got {t.device}")


def _named(op_name: str):
    """Prefix the ValueError/TypeError of a check with the op's name (the message already names
    the argument): a user calling torch.ops.ssm.* directly sees which op refused."""

    def wrap(check):
        @functools.wraps(check)
        def run(*args):
            try:
                check(*args)
            except (ValueError, TypeError) as e:
                raise type(e)(f"{op_name}: {e}") from None

        return run

    return wrap


@_named("ssm::selective_state_update")
def check_selective_state_update_args(state, x, dt, A, B, C, D, z, dt_bias) -> None:
    """Validate the arguments of ``selective_state_update``; errors name the argument."""
    if not isinstance(state, torch.Tensor) or state.dim() != 3:
        raise ValueError(f"state must be a (batch, dim, N) Tensor, got {getattr(state, 'shape', type(state))}")
    if state.dtype != torch.float32:
        raise TypeError(f"state must be fp32 (the recurrent state is kept in fp32 whatever the activation "
                        f"dtype), got {state.dtype}")
    batch, dim, N = state.shape
    if not 1 <= N <= MAX_N:
        # The same range as ssm.selective_scan: a decode step must not accept a model that the
        # prefill's scan refuses.
        raise ValueError(f"state has N={N} state channels; 1 <= N <= {MAX_N} are supported")
    device = state.device
    _check_tensor("x", x, (batch, dim), _ACT_DTYPES, device)
    _check_tensor("dt", dt, (batch, dim), _ACT_DTYPES, device)
    _check_tensor("A", A, (dim, N), _ACT_DTYPES, device)
    if not isinstance(B, torch.Tensor) or B.dim() not in (2, 3):
        raise ValueError(f"B must be (batch, N) or (batch, G, N), got {getattr(B, 'shape', type(B))}")
    G = 1 if B.dim() == 2 else B.shape[1]
    if G < 1 or dim % G != 0:
        raise ValueError(f"B has G={G} groups, which must divide dim={dim}")
    bc_shape = (batch, N) if B.dim() == 2 else (batch, G, N)
    _check_tensor("B", B, bc_shape, _ACT_DTYPES, device)
    _check_tensor("C", C, bc_shape, _ACT_DTYPES, device)
    if D is not None:
        _check_tensor("D", D, (dim,), _ACT_DTYPES, device)
    if z is not None:
        _check_tensor("z", z, (batch, dim), _ACT_DTYPES, device)
    if dt_bias is not None:
        _check_tensor("dt_bias", dt_bias, (dim,), _ACT_DTYPES, device)


@_named("ssm::causal_conv1d_update")
def check_causal_conv1d_update_args(x, conv_state, weight, bias, activation) -> None:
    """Validate the arguments of ``causal_conv1d_update``; errors name the argument."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a (dim, W) Tensor, got {getattr(weight, 'shape', type(weight))}")
    dim, W = weight.shape
    if not MIN_W <= W <= MAX_W:
        raise ValueError(f"weight has width W={W}; expected {MIN_W} <= W <= {MAX_W}")
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3:
        raise ValueError(f"conv_state must be a (batch, dim, S) Tensor, got "
                         f"{getattr(conv_state, 'shape', type(conv_state))}")
    batch, _, S = conv_state.shape
    if S < W - 1:
        raise ValueError(f"conv_state holds S={S} past inputs; the conv of width W={W} needs S >= {W - 1}")
    device = weight.device
    _check_tensor("conv_state", conv_state, (batch, dim, S), _ACT_DTYPES, device)
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        raise ValueError(f"x must be (batch, dim) or (batch, dim, T), got {getattr(x, 'shape', type(x))}")
    if x.dim() == 3 and x.shape[2] < 1:
        raise ValueError(f"x must hold at least one time step, got shape {tuple(x.shape)}")
    if x.shape[0] != batch:
        raise ValueError(f"x has batch {x.shape[0]}, conv_state batch {batch}: they must match")
    _check_tensor("x", x, (batch, dim, *x.shape[2:]), _ACT_DTYPES, device)
    _check_tensor("weight", weight, (dim, W), _ACT_DTYPES, device)
    if bias is not None:
        _check_tensor("bias", bias, (dim,), _ACT_DTYPES, device)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")


def _grouped(B: torch.Tensor) -> torch.Tensor:
    # The kernels take B/C as (batch, G, N); a plain (batch, N) is one group (a view, no copy).
    return B.unsqueeze(1) if B.dim() == 2 else B


@functools.cache
def _triton_decode():
    """The Triton launchers, imported on the first CUDA call (a cached lookup after that)."""
    from . import triton_decode

    return triton_decode


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``t`` can reach, [first, last) (PyTorch strides are >= 0)."""
    first = t.data_ptr()
    return first, first + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _distinct_elements(t: torch.Tensor) -> bool:
    """Whether the strides provably give every element of ``t`` its own address: with the
    dimensions sorted by stride, each stride must step past everything the smaller ones reach.
    That covers every view of a cache a user makes (slices, steps, transposes); a layout that
    fails it is refused, even one that interleaves without overlapping."""
    extent = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= extent:
            return False
        extent += stride * (size - 1)
    return True


def check_no_overlap(op: str, written_name: str, written: torch.Tensor, **read) -> None:
    """An op that writes ``written`` in place reads each tensor of ``read`` whole, before or after
    its write as its kernel schedules it: one that shares memory with ``written`` would see either,
    so it is refused by name (``op`` heads the message). Not part of the cached signature check: it depends on where the
    tensors live, not on their shapes. Only views of one base can share memory (tensors that
    alias without being views, built from one storage by hand, are not looked for): the base
    comparison costs ~0.1 us a tensor on this host-bound path, and the address ranges are read
    only for views of ``written``'s base."""
    if written.numel() == 0:
        return
    if not written.is_contiguous() and not _distinct_elements(written):
        # Two of its elements at one address (an expanded batch of one state, say): each would
        # take whichever update landed last, and the other rows' outputs would read it.
        raise ValueError(f"{op}: {written_name} must not have elements that share memory (strides "
                         f"{tuple(written.stride())} for shape {tuple(written.shape)}, e.g. from expand); "
                         f"the op updates it in place; pass {written_name}.contiguous()")
    root = written if written._base is None else written._base
    w0, w1 = _span(written)
    for name, t in read.items():
        if t is None or t.numel() == 0 or (t if t._base is None else t._base) is not root:
            continue
        r0, r1 = _span(t)
        if r0 < w1 and w0 < r1:
            raise ValueError(f"{op}: {name} shares memory with {written_name}, which the op updates in place; "
                             f"pass a copy ({name}.clone())")


def _state_update_impl(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    _checked_once(check_selective_state_update_args, state, x, dt, A, B, C, D, z, dt_bias)
    check_no_overlap("ssm::selective_state_update", "state", state,
                     x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    B, C = _grouped(B), _grouped(C)
    if state.is_cuda:
        y = _triton_decode().selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
        # The kernel writes through a raw pointer, which autograd's version counter cannot see
        # (the CPU path's copy_ bumps it by itself); the schema's (a!) promises a visible write.
        torch.autograd.graph.increment_version(state)
        return y
    return cpu.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


def _state_update_fake(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    check_selective_state_update_args(state, x, dt, A, B, C, D, z, dt_bias)
    return x.new_empty(x.shape)


def _state_update_functional_impl(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    # The new state is a fresh contiguous tensor, so the in-place kernel's overlap checks hold.
    new = state.clone(memory_format=torch.contiguous_format)
    return _state_update_impl(new, x, dt, A, B, C, D, z, dt_bias, dt_softplus), new


def _state_update_functional_fake(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    check_selective_state_update_args(state, x, dt, A, B, C, D, z, dt_bias)
    return x.new_empty(x.shape), state.new_empty(state.shape)


def _silu_named(activation):
    return "silu" if activation == "swish" else activation


def _conv_update_impl(x, conv_state, weight, bias=None, activation=None):
    _checked_once(check_causal_conv1d_update_args, x, conv_state, weight, bias, activation)
    check_no_overlap("ssm::causal_conv1d_update", "conv_state", conv_state, x=x, weight=weight, bias=bias)
    activation = _silu_named(activation)
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    if x.is_cuda:
        y = _triton_decode().causal_conv1d_update(x3, conv_state, weight, bias, activation)
        # A raw-pointer write, as in _state_update_impl.
        torch.autograd.graph.increment_version(conv_state)
    else:
        y = cpu.causal_conv1d_update(x3, conv_state, weight, bias, activation)
    return y.squeeze(-1) if x.dim() == 2 else y


def _conv_update_fake(x, conv_state, weight, bias=None, activation=None):
    check_causal_conv1d_update_args(x, conv_state, weight, bias, activation)
    return x.new_empty(x.shape)


def _conv_update_functional_impl(x, conv_state, weight, bias=None, activation=None):
    new = conv_state.clone(memory_format=torch.contiguous_format)
    return _conv_update_impl(x, new, weight, bias, activation), new


def _conv_update_functional_fake(x, conv_state, weight, bias=None, activation=None):
    check_causal_conv1d_update_args(x, conv_state, weight, bias, activation)
    return x.new_empty(x.shape), conv_state.new_empty(conv_state.shape)


# Inlined, the kernel reads the state and writes the new one to a fresh buffer, which becomes
# the state's value (``register_inline``'s ``written``): a recorded launch that wrote its state
# argument in place became a ``triton_kernel_wrapper_functional`` that clones it, and inductor
# (torch 2.11, CUDA, static sizes) generated that clone of a state computed from a view with an
# offset (``cache[1].clone()``, ``zeros_like(cache[1]) + cache[1]``) as a copy from offset 0: the
# kernel read ``cache[0]``, y up to ~2.7 off eager (run 54, ``benchmarks/repros/
# decode_inline_states.py``). A fresh output has nothing to clone.
def _state_update_traced(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    check_selective_state_update_args(state, x, dt, A, B, C, D, z, dt_bias)
    new = torch.empty_like(state)
    y = _triton_decode().selective_state_update(state, x, dt, A, _grouped(B), _grouped(C), D, z, dt_bias,
                                                dt_softplus, traced=True, new_state=new)
    return y, new


def _conv_update_traced(x, conv_state, weight, bias=None, activation=None):
    check_causal_conv1d_update_args(x, conv_state, weight, bias, activation)
    activation = _silu_named(activation)
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    new = torch.empty_like(conv_state)
    y = _triton_decode().causal_conv1d_update(x3, conv_state, weight, bias, activation, traced=True, new_state=new)
    return (y.squeeze(-1) if x.dim() == 2 else y), new


# Where a graph is compiled and the op is not inlined (CPU, symbolic sizes), the in-place op is
# traced as its functional twin and a copy into the state. Whole, it becomes
# ``auto_functionalized``, and inductor (torch 2.13) reads the wrong memory for it where the
# state is a view of a stacked cache with symbolic sizes, or a clone of such a view with static
# ones: it regenerates the view from the clone by ``as_strided`` and drops the select's offset,
# so the op read ``cache[0]`` for ``cache[1]`` (probe BG, run 53). A copy into the state is plain
# functionalization, which handles every view.
def _state_update_functional_traced(state, *args):
    y, new = torch.ops.ssm.selective_state_update_functional(state, *args)
    state.copy_(new)
    return y


def _conv_update_functional_traced(x, conv_state, *args):
    y, new = torch.ops.ssm.causal_conv1d_update_functional(x, conv_state, *args)
    conv_state.copy_(new)
    return y


class _NoBackward(torch.autograd.Function):
    """Autograd node of a decode op: it runs the op, and its backward refuses by name."""

    @staticmethod
    def forward(ctx, op, keyset, *args):
        ctx.op_name = op.name()
        with _C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _C._after_autograd_keyset, *args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"Trying to backward through {ctx.op_name} but no autograd formula was registered: "
            f"the decode ops are inference-only (use ssm::selective_scan / ssm::causal_conv1d "
            f"for training)"
        )


def _autograd_kernel(op):
    """The ``Autograd``-key kernel of a decode op: a plain redispatch unless a grad is wanted."""

    written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]

    def kernel(keyset, *args):
        refuse_forward_ad(op.name(), *args)
        if _C.is_grad_enabled() and _C._any_requires_grad(*args):
            for i in written:
                if i < len(args) and args[i].requires_grad and args[i].is_leaf:
                    # What torch's own in-place ops say: the write would be invisible to autograd.
                    raise RuntimeError(f"{op.name()}: a leaf Variable that requires grad ("
                                       f"{op._schema.arguments[i].name}) is being used in an in-place operation.")
            return _NoBackward.apply(op, keyset, *args)
        with _C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _C._after_autograd_keyset, *args)

    return kernel


def check_round_through_args(x, dtype) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"ssm::round_through: x must be a floating-point Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize >= x.dtype.itemsize:
        raise TypeError(f"ssm::round_through: dtype must be a floating-point dtype narrower than x's "
                        f"{x.dtype}, got {dtype}")


def round_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype``'s precision, returned in x's dtype: ``x.to(dtype).to(x.dtype)``.

    A decode rewrite hands ``causal_conv1d_update`` the newest input as the replaced code read
    it back from a narrower conv state. Written as two casts, that round trip is folded away by
    inductor's C++ backend before torch 2.13 (it caches the down-cast's source as the up-cast's
    result, ``emulate_precision_casts`` or not), and by its Triton code unless the whole graph
    emulates casts; as an op, it is a call inductor does not look into."""
    check_round_through_args(x, dtype)
    return x.to(dtype).to(x.dtype)


def _round_through_fake(x, dtype):
    check_round_through_args(x, dtype)
    return torch.empty_like(x)


def _round_through_backward(ctx, grad):
    # Eager's two casts round the gradient the same way on the way back.
    return grad.to(ctx.dtype).to(grad.dtype), None


def _round_through_setup(ctx, inputs, output):
    ctx.dtype = inputs[1]


@functools.cache
def register() -> torch.library.Library:
    """Define ``ssm::selective_state_update``, ``ssm::causal_conv1d_update``, their functional
    twins and ``ssm::round_through`` (idempotent).

    Returns the ``Library`` fragment; the cache keeps it alive, which keeps the ops defined.
    """
    lib = torch.library.Library("ssm", "FRAGMENT")
    for schema, impl, fake, traced, functional, written in (
        (_STATE_UPDATE_SCHEMA, _state_update_impl, _state_update_fake, _state_update_traced,
         _state_update_functional_traced, 0),
        (_CONV_UPDATE_SCHEMA, _conv_update_impl, _conv_update_fake, _conv_update_traced,
         _conv_update_functional_traced, 1),
        (_STATE_UPDATE_FUNCTIONAL_SCHEMA, _state_update_functional_impl, _state_update_functional_fake, None, None,
         None),
        (_CONV_UPDATE_FUNCTIONAL_SCHEMA, _conv_update_functional_impl, _conv_update_functional_fake, None, None,
         None),
    ):
        name = schema[: schema.index("(")]
        lib.define(schema)
        for device_key in ("CPU", "CUDA"):
            lib.impl(name, without_autocast(impl, device_key.lower()), device_key)
        torch.library.register_fake(f"ssm::{name}", fake, lib=lib)
        op = getattr(torch.ops.ssm, name).default
        lib.impl(name, _autograd_kernel(op), "Autograd", with_keyset=True)
        if traced is not None:
            # Compiled on CUDA, the op is its kernel's launch in inductor's code (``kernels/inline.py``).
            # The functional twins stay calls of the op: they run where the state is a view, off
            # the per-layer path of a model whose cache holds one tensor per layer.
            register_inline(lib, f"ssm::{name}", traced, functional, written)
    lib.define(_ROUND_THROUGH_SCHEMA)
    for device_key in ("CPU", "CUDA"):
        lib.impl("round_through", round_through, device_key)
    torch.library.register_fake("ssm::round_through", _round_through_fake, lib=lib)
    register_autograd(lib, "round_through", _round_through_backward, _round_through_setup)
    return lib


_ensure_registered = registration_guard(register)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One decode step of the selective SSM; updates ``state`` in place and returns the output.

    h = exp(dt * A) * h + dt * B * x (per channel), y = C . h + D * x, y *= silu(z), where
    dt = softplus(dt + dt_bias) if ``dt_softplus`` else dt + dt_bias. Computed in fp32.

    Args:
        state: (batch, dim, N) fp32, the recurrent state; overwritten with the new state.
        x: (batch, dim) input of this step (fp32, bf16 or fp16).
        dt: (batch, dim) time step, before bias and softplus.
        A: (dim, N) state matrix (negative reals).
        B, C: (batch, N), or grouped (batch, G, N) with dim % G == 0.
        D: (dim,) skip weight, or None. z: (batch, dim) gate, or None.
        dt_bias: (dim,) or None. dt_softplus: apply softplus to dt + dt_bias.

    Returns:
        y: (batch, dim) in x's dtype.

    Example:
        >>> state = torch.zeros(2, 64, 16)
        >>> y = selective_state_update(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True)
    """
    _ensure_registered()
    return torch.ops.ssm.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """Depthwise causal conv over new inputs, continuing from a rolling window of past inputs.

    y[t] = bias + sum_k weight[:, k] * cat(conv_state, x)[S - (W - 1) + t + k], then the
    activation; afterwards ``conv_state`` holds the last S inputs (rolled left by T).

    Args:
        x: (batch, dim) one new input, or (batch, dim, T) several.
        conv_state: (batch, dim, S) with S >= W - 1, the S inputs before x (oldest first);
            updated in place.
        weight: (dim, W) with 2 <= W <= 8. bias: (dim,) or None.
        activation: None or "silu".

    Returns:
        y: shaped like x, in x's dtype.

    Example:
        >>> conv_state = torch.zeros(2, 64, 4)
        >>> y = causal_conv1d_update(x, conv_state, weight, bias, activation="silu")  # x: (2, 64)
    """
    _ensure_registered()
    return torch.ops.ssm.causal_conv1d_update(x, conv_state, weight, bias, activation)
