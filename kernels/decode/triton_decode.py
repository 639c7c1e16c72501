"""Triton kernels for the decode ops: one program per (batch, block of channels).

Neither kernel is autotuned: both update their state in place, and autotuning re-runs the
kernel on the same buffers, which would apply the update several times.

Each launcher takes ``traced``: False launches the kernel now (the ops' CUDA kernels); True
launches it through ``torch.library.wrap_triton``, which records the launch in a graph being
traced, so that inductor compiles the launch into its own code (``kernels/inline.py``).
"""
import torch
import triton
import triton.language as tl

from ..triton_common import LOG2E, launcher, silu, softplus


@triton.jit
def _selective_state_update_kernel(
    # pointers
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, new_state_ptr,
    # sizes
    dim, N, dim_per_group,
    # strides
    stride_state_b, stride_state_d, stride_state_n,
    stride_new_b, stride_new_d, stride_new_n,
    stride_x_b, stride_x_d,
    stride_dt_b, stride_dt_d,
    stride_A_d, stride_A_n,
    stride_B_b, stride_B_g, stride_B_n,
    stride_C_b, stride_C_g, stride_C_n,
    stride_D_d,
    stride_z_b, stride_z_d,
    stride_dt_bias_d,
    stride_y_b, stride_y_d,
    # meta-parameters
    DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < dim
    mask_dn = mask_d[:, None] & (offs_n[None, :] < N)
    # A block of channels may straddle two groups, so the group is looked up per channel.
    offs_g = offs_d // dim_per_group

    state_ptrs = (state_ptr + pid_b * stride_state_b
                  + offs_d[:, None] * stride_state_d + offs_n[None, :] * stride_state_n)
    h = tl.load(state_ptrs, mask=mask_dn, other=0.0)  # [BLOCK_D, BLOCK_N]
    x = tl.load(x_ptr + pid_b * stride_x_b + offs_d * stride_x_d, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * stride_dt_b + offs_d * stride_dt_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + offs_d * stride_dt_bias_d, mask=mask_d, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        dt = softplus(dt)
    A = tl.load(A_ptr + offs_d[:, None] * stride_A_d + offs_n[None, :] * stride_A_n,
                mask=mask_dn, other=0.0).to(tl.float32)
    B = tl.load(B_ptr + pid_b * stride_B_b + offs_g[:, None] * stride_B_g + offs_n[None, :] * stride_B_n,
                mask=mask_dn, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + pid_b * stride_C_b + offs_g[:, None] * stride_C_g + offs_n[None, :] * stride_C_n,
                mask=mask_dn, other=0.0).to(tl.float32)

    dA = tl.exp2(dt[:, None] * A * LOG2E)
    # Padded lanes load h = B = 0, so they stay 0 and add nothing to the readout.
    h = h * dA + (dt * x)[:, None] * B  # [BLOCK_D, BLOCK_N]
    tl.store(new_state_ptr + pid_b * stride_new_b + offs_d[:, None] * stride_new_d + offs_n[None, :] * stride_new_n,
             h, mask=mask_dn)

    y = tl.sum(h * C, axis=1)
    if HAS_D:
        y += tl.load(D_ptr + offs_d * stride_D_d, mask=mask_d, other=0.0).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + pid_b * stride_z_b + offs_d * stride_z_d, mask=mask_d, other=0.0).to(tl.float32)
        y *= silu(z)
    tl.store(y_ptr + pid_b * stride_y_b + offs_d * stride_y_d, y.to(y_ptr.dtype.element_ty), mask=mask_d)


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, traced=False,
                           new_state=None) -> torch.Tensor:
    """Launch one recurrence step; ``state`` (batch, dim, N) fp32 is updated in place, or read
    and the new state written to ``new_state`` (same shape) where one is given.

    x, dt, z: (batch, dim); A: (dim, N); B, C: (batch, G, N); D, dt_bias: (dim,). Returns y.
    """
    new_state = state if new_state is None else new_state
    batch, dim = x.shape
    G, N = B.shape[1], B.shape[2]
    y = torch.empty((batch, dim), dtype=x.dtype, device=x.device)
    BLOCK_N = max(triton.next_power_of_2(N), 2)
    # Keep the state tile near 512 fp32 values per program: larger N means fewer channels each.
    BLOCK_D = max(512 // BLOCK_N, 2)
    grid = (batch, triton.cdiv(dim, BLOCK_D))
    kernel, options = launcher(_selective_state_update_kernel, traced)
    kernel[grid](
        state, x, dt, A, B, C, D, z, dt_bias, y, new_state,
        dim, N, dim // G,
        state.stride(0), state.stride(1), state.stride(2),
        new_state.stride(0), new_state.stride(1), new_state.stride(2),
        x.stride(0), x.stride(1),
        dt.stride(0), dt.stride(1),
        A.stride(0), A.stride(1),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        0 if D is None else D.stride(0),
        0 if z is None else z.stride(0), 0 if z is None else z.stride(1),
        0 if dt_bias is None else dt_bias.stride(0),
        y.stride(0), y.stride(1),
        DT_SOFTPLUS=dt_softplus,
        # Flags as arguments, not @triton.heuristics, which rebuilds a dict of every argument per
        # flag on each launch: decode is one launch per token, so host cost is its speed limit.
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None,
        BLOCK_D=BLOCK_D,
        BLOCK_N=BLOCK_N,
        num_warps=4 if BLOCK_N <= 64 else 8,
        **options,
    )
    return y


@triton.jit
def _causal_conv1d_update_kernel(
    # pointers
    x_ptr, conv_state_ptr, w_ptr, bias_ptr, y_ptr, new_state_ptr,
    # sizes
    dim, T, S, W,
    # strides
    stride_x_b, stride_x_d, stride_x_t,
    stride_state_b, stride_state_d, stride_state_s,
    stride_new_b, stride_new_d, stride_new_s,
    stride_w_d, stride_w_k,
    stride_bias_d,
    stride_y_b, stride_y_d, stride_y_t,
    # meta-parameters
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_W)
    mask_d = offs_d < dim
    mask_dk = mask_d[:, None] & (offs_k[None, :] < W)
    x_base = x_ptr + pid_b * stride_x_b + offs_d[:, None] * stride_x_d
    state_base = conv_state_ptr + pid_b * stride_state_b + offs_d[:, None] * stride_state_d
    new_base = new_state_ptr + pid_b * stride_new_b + offs_d[:, None] * stride_new_d

    w = tl.load(w_ptr + offs_d[:, None] * stride_w_d + offs_k[None, :] * stride_w_k,
                mask=mask_dk, other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_W]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias_d, mask=mask_d, other=0.0).to(tl.float32)

    # Output t reads positions S - (W - 1) + t + k of the virtual sequence cat(conv_state, x):
    # below S from the state, from S on from x. Nothing is written until every read is done.
    for t in range(T):
        j = S - (W - 1) + t + offs_k[None, :]
        from_state = j < S
        win_state = tl.load(state_base + j * stride_state_s, mask=mask_dk & from_state, other=0.0)
        win_x = tl.load(x_base + (j - S) * stride_x_t, mask=mask_dk & (j >= S), other=0.0)
        win = tl.where(from_state, win_state.to(tl.float32), win_x.to(tl.float32))  # [BLOCK_D, BLOCK_W]
        acc = tl.sum(win * w, axis=1)
        if HAS_BIAS:
            acc += bias
        if SILU:
            acc = silu(acc)
        tl.store(y_ptr + pid_b * stride_y_b + offs_d * stride_y_d + t * stride_y_t,
                 acc.to(y_ptr.dtype.element_ty), mask=mask_d)

    # Roll the state left by T: new[s] = cat(state, x)[s + T], in place where new_state_ptr is the
    # state. Chunks go in rising s, so a chunk only reads positions no earlier chunk wrote; inside
    # a chunk the barrier makes every thread finish reading before any thread overwrites a
    # position another still needs.
    tl.debug_barrier()
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)[None, :]
        mask_ds = mask_d[:, None] & (offs_s < S)
        src = offs_s + T
        from_state = src < S
        old = tl.load(state_base + src * stride_state_s, mask=mask_ds & from_state, other=0.0)
        new = tl.load(x_base + (src - S) * stride_x_t, mask=mask_ds & (src >= S), other=0.0)
        rolled = tl.where(from_state, old, new.to(conv_state_ptr.dtype.element_ty))  # [BLOCK_D, BLOCK_S]
        tl.debug_barrier()
        tl.store(new_base + offs_s * stride_new_s, rolled, mask=mask_ds)


def causal_conv1d_update(x, conv_state, weight, bias, activation, traced=False, new_state=None) -> torch.Tensor:
    """Launch T conv steps; ``conv_state`` (batch, dim, S) is rolled left by T in place, or read and
    the rolled state written to ``new_state`` (same shape) where one is given.

    x: (batch, dim, T); weight: (dim, W); bias: (dim,). Returns y (batch, dim, T).
    """
    new_state = conv_state if new_state is None else new_state
    batch, dim, T = x.shape
    S, W = conv_state.shape[-1], weight.shape[-1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    BLOCK_D = 64
    grid = (batch, triton.cdiv(dim, BLOCK_D))
    kernel, options = launcher(_causal_conv1d_update_kernel, traced)
    kernel[grid](
        x, conv_state, weight, bias, y, new_state,
        dim, T, S, W,
        x.stride(0), x.stride(1), x.stride(2),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        new_state.stride(0), new_state.stride(1), new_state.stride(2),
        weight.stride(0), weight.stride(1),
        0 if bias is None else bias.stride(0),
        y.stride(0), y.stride(1), y.stride(2),
        SILU=activation == "silu",
        HAS_BIAS=bias is not None,
        BLOCK_D=BLOCK_D,
        BLOCK_W=triton.next_power_of_2(W),
        BLOCK_S=min(triton.next_power_of_2(S), 32),
        num_warps=2,
        **options,
    )
    return y
