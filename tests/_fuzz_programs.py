"""A seeded grammar of Mamba-1 selective-scan programs, for ``test_fuzz_scan.py``.

``generate(seed)`` draws one ``Program``: independent choices among spellings that all compute
the textbook scan (the grammar below), at most one mutation, and the Python source of a function
``scan_program(...)`` that spells those choices. The source is exec'd into a real function, so
dynamo traces ordinary Python (loops, zip, enumerate, list appends) as it would trace user code,
and the source is kept so that a failure can be pasted as a self-contained repro.

One ``random.Random(seed)`` makes every choice, so a seed always gives the same program, and the
program's ``id`` names every choice.
"""
from __future__ import annotations

import dataclasses
import random
import textwrap
from typing import Any, Callable

import torch

# --- the grammar ------------------------------------------------------------------------------
#
# io        layout of u, Δ, z and y at the function's boundary: "bdl" (batch, dim, L), mamba_ssm's
#           selective_scan_ref, or "bld" (batch, L, dim), mamba-minimal's.
# layout    layout the scan is computed in: the full terms are (batch, dim, L, N) in "bdl",
#           (batch, L, dim, N) in "bld". When it differs from io, u and Δ are transposed on the
#           way in and y on the way out (so the tail folds must see through the permutation).
# store     "transposed": u, Δ, z, B, C arrive with axes 1 and 2 swapped in memory (the same
#           values; a channel-innermost u is what an nn.Linear output transposed gives).
# A         "A" passed in, or "A_log" with A = -exp(A_log) computed in the function.
# B         "bnl" (batch, N, L) | "bln" (batch, L, N) | "grouped" (batch, G, N, L), G dividing dim,
#           expanded to its group's channels by repeat_interleave (selective_scan_ref's
#           B.dim() == 4) | "shared": one time-invariant (dim, N) B (is_variable_B false).
# C         "bnl" | "bln". (A time-invariant (dim, N) C is left out: explain names it as
#           unsupported, test_unseen_scan6 pins that.)
# BC        "same": one tensor passed as both B and C (where their shapes agree).
# disc      exp(Δ·A) as "exp_unsqueeze" (torch.exp(Δ.unsqueeze(-1) * A)), "exp_commuted"
#           (torch.exp(A * Δ.unsqueeze(-1))), "einsum" (exp(einsum('bdl,dn->bdln'))) or
#           "method_exp" ((Δ[..., None] * A).exp()).
# input     Δ·B·u as "broadcast" ((Δ*u)[..., None] * B), "three" (Δ[..., None] * B * u[..., None],
#           HF's order) or one "einsum".
# where     "full": both terms for every step computed before the loop and sliced in it;
#           "step": computed inside the loop from the step's slices of Δ, u and B.
# loop      "range" (for t in range(L) + indexing), "while" (t = 0; while t < L: ...; t += 1),
#           "zip" (zip over unbind()s), "enumerate" (enumerate(zip(...))), "assoc"
#           (associative_scan with combine_mode="generic", then one readout of all the states:
#           HF's use_associative_scan path; the "pointwise" mode has no eager CPU reference).
# slice     how indexed loops take step t: "index" x[:, :, t], "select" x.select(2, t),
#           "ellipsis" x[..., t] / x[..., t, :] / x[:, t, ...].
# combine   (assoc) "hf" (a1*a2, a2*b1 + b2), "swapped" (a2*a1, b2 + b1*a2), "addcmul"
#           (a1*a2, torch.addcmul(b2, a2, b1)).
# update    "a_h" (a*h + b), "h_a" (h*a + b), "addcmul" (torch.addcmul(b, a, h)), "method"
#           (h.mul(a).add(b)).
# init      "zeros" (torch.zeros(..., dtype=u.dtype)), "zeros_f32" (torch.zeros(...) in the
#           default float32, promoted at step 0: mamba-minimal's), "new_zeros" (u.new_zeros),
#           "zeros_like" (torch.zeros_like(a step's decay)), "bcast_zeros" ((batch, dim, 1) zeros,
#           broadcast over N at step 0).
# readout   "mul_sum" ((h*C_t[:, None]).sum(-1)), "einsum" ('bdn,bn->bd'), "bmm"
#           (torch.bmm(h, C_t[..., None]).squeeze(-1)), "matmul" ((h @ C_t[:, :, None])[..., 0]),
#           "keepdim" (sum(-1, keepdim=True).squeeze(-1)), "vecdot" (torch.linalg.vecdot); the
#           same kinds over all states at once for "assoc" and collect "states".
# cast      "yes": the state read out through a no-op .to(u.dtype) (HF's .to(input_dtype)).
# collect   "stack" (list + torch.stack), "cat" (unsqueezed outputs + torch.cat), "prealloc"
#           (writes into a fresh buffer: ys[:, :, t] = y, or ys.select(2, t).copy_(y)), "states"
#           (the states stacked, then read out at once: mamba.py's selective_scan_seq).
# neg_dims  "yes": stack/cat/unsqueeze along time counted from the right (dim=-1, -2).
# softplus  "yes": Δ = softplus(dt + dt_bias) in the function.
# skip      "no" | "u_D" (y + u*D) | "D_u" (y + D*u) | "in_loop" (y_t + D*u_t, collected).
# gate      "no" | "silu" (y * silu(z)) | "sigmoid" (y * (z*sigmoid(z))) | "in_loop" (y_t * silu(z_t)).
# calls     "twice": the scan as a local function, run forwards and over the time-flipped inputs
#           (a Vision-Mamba-style bidirectional block): two scans in one graph.
# ret       "y" | "y_h": also the last state.
#
# Correct spellings left out of the grammar because the passes refuse them (by design or as a
# known limitation), with explain's reason:
#   - h = a*h; h += b (in place on a fresh product): "the state update uses an op that is not an
#     elementwise add/mul (in-place iadd)".
#   - all the states returned besides y (return y, hs): "the states are used by output, which is
#     neither a readout Σ_n h·C nor the last state" (the op never materialises them).
#   - a time flip of the expanded grouped B (B.repeat_interleave(...).flip(-1)): read per channel
#     (G = dim), and under grad, next to the grammar's C, "B is per channel (batch, dim, N, L) and C
#     is shared by the channels, with gradients recorded"; the grammar flips the (batch, G, N, L) B
#     and expands it inside the scan instead.
# Two more are drawn as "still a scan" mutations whose rewrite is not required (UNSUPPORTED).

INITS = ("zeros", "zeros_f32", "new_zeros", "zeros_like", "bcast_zeros")
READOUTS = ("mul_sum", "einsum", "bmm", "matmul", "keepdim", "vecdot")
INDEXED = ("range", "enumerate", "while")
ALL_LOOPS = ("range", "zip", "enumerate", "while", "assoc")
STEP_LOOPS = ("range", "zip", "enumerate", "while")

# Mutations, with the loops each can be written in.
#
# Near misses: no selective scan of the program's u, Δ, A, B, C computes these, so the scan must
# be left alone, with a reason in explain.
#   stale       the input term of step t is step t-1's (index t-1: step 0 reads step L-1; or
#               carried from the previous iteration, zero at step 0; assoc: shifted one step).
#               h_t = a_t h + b_{t-1} pairs Δ_t's decay with Δ_{t-1}'s input.
#   stale_decay the decay of step t is step t-1's (the same, the other way round).
#   tanh        h = tanh(a*h + b): not linear in h (assoc: tanh of the states, before the readout).
#   reset       h = 0 at t == L // 2: the recurrence restarts mid-sequence.
#   freeze      no update at t == L // 2: h_{L/2} = h_{L/2 - 1}.
#   lagged      y_t reads h_{t-1} (the readout before the update; assoc: states shifted one step).
#   decay       h = 0.9 * a * h + b: still linear, but 0.9·exp(Δ·A) = exp(Δ·A') holds for no
#               constant A' (A' = A + log(0.9)/Δ varies with Δ).
#   half_state  y_t reads a_t * h_{t-1}: the state decayed but without step t's input.
#   sq_readout  y_t = Σ_n h²·C_t: a readout that is not linear in h.
#   order       (assoc) the combine (a1*a2, a1*b2 + b1): the right-to-left composition.
#   mid_state   the state at t == L // 2 is returned: the op gives only the last state.
#   state_leak  y_t = Σ_n h·C_t + 0.1 * mean_n(h): h read besides the readout.
#   skip_shift  the skip adds D*u_{t-1} (u rolled one step): the scan itself is exact and must be
#               rewritten; the skip must not be folded into the op's D.
# Still scans: they look like mutations, but compute the Mamba-1 scan of the same inputs, so a
# rewrite is allowed (and then must be exact).
#   init_ones   h_{-1} = 1, made in the function: the op's initial_state.
#   in_scale    h = a*h + 0.5*b: the input term of B' = 0.5·B.
#   out_scale   y_t = 2 * Σ_n h·C_t: the readout of C' = 2·C.
#   first_step  h = b_0 written out, then range(1, L).
MUTATION_LOOPS = {
    "stale": ALL_LOOPS, "stale_decay": ALL_LOOPS, "tanh": ALL_LOOPS, "reset": INDEXED, "freeze": INDEXED,
    "lagged": ALL_LOOPS, "decay": ALL_LOOPS, "half_state": STEP_LOOPS, "sq_readout": ALL_LOOPS, "order": ("assoc",),
    "skip_shift": ALL_LOOPS, "mid_state": INDEXED, "state_leak": STEP_LOOPS,
    "init_ones": STEP_LOOPS, "in_scale": ALL_LOOPS, "out_scale": ALL_LOOPS, "first_step": ("range",),
    "reversed_collect": STEP_LOOPS, "prefix": ("range",), "c_reversed": ("range",),
}
NEAR_MISSES = ("stale", "stale_decay", "tanh", "reset", "freeze", "lagged", "decay", "half_state", "sq_readout",
               "order", "skip_shift", "mid_state", "state_leak")
STILL_SCANS = ("init_ones", "in_scale", "out_scale", "first_step")
# Neither: a scan put to another use, which a rewrite may keep or leave (exactness either way).
#   reversed_collect  the per-step outputs (or states) collected in reverse: torch.stack(ys[::-1]).
#   prefix            range(L - 1): a scan of the first L-1 steps (into a preallocated buffer, the
#                     last step stays zero).
#   c_reversed        step t reads C at L-1-t: the scan read out by a time-reversed C.
EITHER = ("reversed_collect", "prefix", "c_reversed")
# Near misses in the tail: the scan is exact and is rewritten; only the fold is refused.
TAIL_NEAR_MISSES = ("skip_shift",)
# Still scans that the passes leave alone (with a reason): exactness is required, a rewrite is not.
#   first_step: refused by scan_loop ("the loop's first state is itself a time slice ...: that
#               equals a scan from h = 0 only where exp(Δ·A) at t = 0 is finite", or "the state
#               update at step 0 reads its inputs at time index 1, not 0").
#   in_scale:   "the state's addend is not a product Δ·B·u" (scan_loop) / "B_full is not a product
#               Δ·B·u (found 1 factors)" (scan_assoc): a constant factor on Δ·B·u is not matched.
UNSUPPORTED = ("first_step", "in_scale")


@dataclasses.dataclass
class Program:
    seed: int
    shape: tuple[int, int, int, int]  # batch, dim, N, L
    choice: dict[str, str]
    mutation: str | None
    source: str
    arg_names: tuple[str, ...]
    grads: bool

    @property
    def id(self) -> str:
        b, d, n, L = self.shape
        parts = [f"s{self.seed}", f"d{d}n{n}L{L}"] + [f"{k}={v}" for k, v in self.choice.items()]
        if self.mutation:
            parts.append(f"MUT={self.mutation}")
        return "-".join(parts)

    @property
    def expect_rewrite(self) -> bool | None:
        """True: the scan must be rewritten; False: it must not; None: either (exact anyway)."""
        if self.mutation is None or self.mutation in TAIL_NEAR_MISSES:
            return True
        if self.mutation in NEAR_MISSES:
            return False
        return None if self.mutation in UNSUPPORTED + EITHER else True

    def function(self) -> Callable:
        namespace: dict[str, Any] = {}
        exec(compile(self.source, f"<fuzz seed {self.seed}>", "exec"), namespace)
        return namespace["scan_program"]

    def inputs(self) -> list[torch.Tensor]:
        """fp64 leaves for ``arg_names``, seeded by the program's seed, needing gradients when
        ``grads``."""
        b, d, n, L = self.shape
        g = torch.Generator().manual_seed(self.seed)
        io = self.choice["io"]

        def act(positive=False):
            x = (torch.rand(b, d, L, generator=g, dtype=torch.float64) * 0.5 + 0.05 if positive
                 else torch.randn(b, d, L, generator=g, dtype=torch.float64))
            return x if io == "bdl" else x.transpose(1, 2).contiguous()

        def bc(form):
            if form == "shared":
                return torch.randn(d, n, generator=g, dtype=torch.float64)
            if form == "grouped":
                return torch.randn(b, int(self.choice["G"]), n, L, generator=g, dtype=torch.float64)
            x = torch.randn(b, n, L, generator=g, dtype=torch.float64)
            return x if form == "bnl" else x.transpose(1, 2).contiguous()

        A = -torch.rand(d, n, generator=g, dtype=torch.float64) - 0.5
        made = {
            "u": act(),
            # softplus(dt + bias) makes its own positive Δ; otherwise Δ in [0.05, 0.55).
            "delta": act(positive=self.choice["softplus"] == "no"),
            "A": A,
            "A_log": torch.log(-A),
            "B": bc(self.choice["B"]),
            "C": bc(self.choice["C"]),
            "D": torch.randn(d, generator=g, dtype=torch.float64),
            "z": act(),
            "dt_bias": torch.randn(d, generator=g, dtype=torch.float64) * 0.5,
        }
        if self.choice["store"] == "transposed":
            # The same values with axes 1 and 2 swapped in memory (a channel-innermost u, as an
            # nn.Linear output transposed gives): the passes must not assume contiguity.
            for name in ("u", "delta", "z", "B", "C"):
                if made[name].dim() == 3:
                    made[name] = made[name].transpose(1, 2).contiguous().transpose(1, 2)
        leaves = {name: made[name].detach().requires_grad_(self.grads) for name in self.arg_names}
        if self.choice["BC"] == "same":
            leaves["C"] = leaves["B"]  # one tensor passed as B and as C
        return [leaves[name] for name in self.arg_names]


# --- rendering --------------------------------------------------------------------------------

class _Spell:
    """The expressions of one program: every slice, broadcast and einsum string the renderer
    needs. Time is axis 2 of (batch, dim, L[, N]) values in "bdl" and axis 1 in "bld"."""

    def __init__(self, c: dict[str, str]):
        self.c = c
        self.lay = c["layout"]
        self.tax = 2 if self.lay == "bdl" else 1
        self.l_sub = self.lay                       # einsum subscripts of u / Δ
        self.full_sub = self.lay + "n"              # of the (…, N) full terms
        self.slice = c.get("slice", "index")

    def act_t(self, x: str, t: str, full: bool = False) -> str:
        """Step t of a (batch, dim, L)-like value, or of a ``full`` (…, N) term, of the compute
        layout."""
        if self.slice == "select":
            return f"{x}.select({self.tax}, {t})"
        if self.slice == "ellipsis":
            # Time counted from the right in "bdl" (x[..., t] or x[..., t, :]), "bld" keeps a
            # trailing ellipsis.
            if self.lay == "bld":
                return f"{x}[:, {t}, ...]"
            return f"{x}[..., {t}, :]" if full else f"{x}[..., {t}]"
        return f"{x}[:, :, {t}]" if self.lay == "bdl" else f"{x}[:, {t}]"

    def write_t(self, buf: str, t: str, y: str) -> str:
        if self.slice == "select":
            return f"{buf}.select({self.tax}, {t}).copy_({y})"
        return f"{self.act_t(buf, t)} = {y}"

    def bc_t(self, x: str, form: str, t: str) -> str:
        """Step t of B or C: (batch, N), or (batch, dim, N) for the expanded grouped B."""
        if form == "grouped":
            return f"{x}[..., {t}]"
        if self.slice == "select":
            return f"{x}.select({2 if form == 'bnl' else 1}, {t})"
        return f"{x}[:, :, {t}]" if form == "bnl" else f"{x}[:, {t}]"

    def bc_unbind(self, x: str, form: str) -> str:
        return {"bnl": f"{x}.unbind(2)", "bln": f"{x}.unbind(1)", "grouped": f"{x}.unbind(-1)"}[form]

    def act_unbind(self, x: str) -> str:
        return f"{x}.unbind({self.tax})"

    def a_expand(self) -> str:
        """A (dim, N) broadcast against Δ.unsqueeze(-1) of the compute layout."""
        return "A[:, None, :]" if self.lay == "bdl" else "A"

    @staticmethod
    def bc_sub(form: str) -> str:
        return {"bnl": "bnl", "bln": "bln", "grouped": "bdnl", "shared": "dn"}[form]

    def b_full(self, form: str) -> str:
        """B as a value broadcasting against a full (…, N) term."""
        if self.lay == "bdl":
            return {"bnl": "B.transpose(1, 2)[:, None]", "bln": "B[:, None]",
                    "grouped": "B.transpose(-1, -2)", "shared": "B[:, None, :]"}[form]
        return {"bnl": "B.transpose(1, 2)[:, :, None]", "bln": "B[:, :, None]",
                "grouped": "B.permute(0, 3, 1, 2)", "shared": "B"}[form]

    def c_bcast(self) -> str:
        """C broadcasting against all the states, (…, N)."""
        cl = "C" if self.c["C"] == "bln" else "C.transpose(1, 2)"
        return f"{cl}[:, None]" if self.lay == "bdl" else f"{cl}[:, :, None]"

    def shifted(self, x: str, fill: str = "zeros") -> str:
        """x one step later in time, ``fill`` first: x_{t-1}."""
        ax = self.tax
        head = f"{x}[:, :, :1]" if ax == 2 else f"{x}[:, :1]"
        tail = f"{x}[:, :, :-1]" if ax == 2 else f"{x}[:, :-1]"
        return f"torch.cat([torch.{fill}_like({head}), {tail}], {ax})"


def _step_readout(kind: str, h: str, c: str) -> str:
    """y_t (batch, dim) = Σ_n h[b, d, n] c[b, n]."""
    return {
        "mul_sum": f"({h} * {c}[:, None, :]).sum(-1)",
        "einsum": f"torch.einsum('bdn,bn->bd', {h}, {c})",
        "bmm": f"torch.bmm({h}, {c}.unsqueeze(-1)).squeeze(-1)",
        "matmul": f"({h} @ {c}[:, :, None])[..., 0]",
        "keepdim": f"({h} * {c}.unsqueeze(1)).sum(-1, keepdim=True).squeeze(-1)",
        "vecdot": f"torch.linalg.vecdot({h}, {c}[:, None])",
    }[kind]


def _states_readout(kind: str, sp: _Spell, hs: str) -> str:
    """y (compute layout) = Σ_n hs[..., n] C[b, t, n], all the states at once."""
    cb = sp.c_bcast()
    return {
        "mul_sum": f"({hs} * {cb}).sum(-1)",
        "einsum": f"torch.einsum('{sp.full_sub},{sp.bc_sub(sp.c['C'])}->{sp.l_sub}', {hs}, C)",
        "bmm": f"({hs}.unsqueeze(-2) @ {cb}.unsqueeze(-1)).squeeze(-1).squeeze(-1)",
        "matmul": f"torch.matmul({hs}[..., None, :], {cb}[..., None])[..., 0, 0]",
        "keepdim": f"({hs} * {cb}).sum(-1, keepdim=True).squeeze(-1)",
        "vecdot": f"torch.linalg.vecdot({hs}, {cb})",
    }[kind]


_COMBINES = {
    "hf": "lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1])",
    "swapped": "lambda l, r: (r[0] * l[0], r[1] + l[1] * r[0])",
    "addcmul": "lambda l, r: (l[0] * r[0], torch.addcmul(r[1], r[0], l[1]))",
    # The mutation "order": b = a_l*b_r + b_l composes the maps right to left.
    "order": "lambda l, r: (l[0] * r[0], l[0] * r[1] + l[1])",
}


def _render(c: dict[str, str], mut: str | None) -> tuple[str, tuple[str, ...]]:
    sp = _Spell(c)
    lines: list[str] = []
    emit = lines.append
    tax = sp.tax
    args = ["u", "delta", c["A"], "B", "C"]
    if c["skip"] != "no":
        args.append("D")
    if c["gate"] != "no":
        args.append("z")
    if c["softplus"] == "yes":
        args.append("dt_bias")
    transposed = c["io"] != c["layout"]

    # Prologue, in the io layout: Δ's softplus, then the move to the compute layout.
    if c["softplus"] == "yes":
        emit(f"delta = F.softplus(delta + {'dt_bias[:, None]' if c['io'] == 'bdl' else 'dt_bias'})")
    if c["A"] == "A_log":
        emit("A = -torch.exp(A_log)")
    if transposed:
        emit("x = u  # the skip reads u in the io layout")
        emit("u, delta = u.transpose(1, 2), delta.transpose(1, 2)")
        if c["gate"] == "in_loop":
            emit("z = z.transpose(1, 2)")
    L = f"u.shape[{tax}]"
    core_start = len(lines)
    if c["B"] == "grouped":
        # selective_scan_ref: B (batch, G, N, L) -> (batch, dim, N, L), each group's B shared by
        # dim // G consecutive channels. (Part of the scan, so that a second, time-flipped call
        # flips the groups' B and expands it itself: a flip of the expanded B is read per channel,
        # and refused under grad next to a C shared by the channels.)
        emit(f"B = B.repeat_interleave(u.shape[{3 - tax}] // B.shape[1], dim=1)")
    # Collected outputs are stacked along time, counted from the left or (neg_dims) the right.
    y_dim = tax - 3 if c["neg_dims"] == "yes" else tax
    hs_dim = tax - 4 if c["neg_dims"] == "yes" else tax

    def full_terms():
        if c["disc"] == "exp_unsqueeze":
            emit(f"dA = torch.exp(delta.unsqueeze(-1) * {sp.a_expand()})")
        elif c["disc"] == "einsum":
            emit(f"dA = torch.exp(torch.einsum('{sp.l_sub},dn->{sp.full_sub}', delta, A))")
        elif c["disc"] == "exp_commuted":
            emit(f"dA = torch.exp({sp.a_expand()} * delta.unsqueeze(-1))")
        else:
            emit(f"dA = (delta[..., None] * {sp.a_expand()}).exp()")
        if c["input"] == "einsum":
            emit(f"dBu = torch.einsum('{sp.l_sub},{sp.bc_sub(c['B'])},{sp.l_sub}->{sp.full_sub}', delta, B, u)")
        elif c["input"] == "three":
            # HF's order: (Δ ⊗ B) first, then u.
            emit(f"dBu = delta.unsqueeze(-1) * {sp.b_full(c['B'])} * u.unsqueeze(-1)")
        else:
            emit(f"dBu = (delta * u).unsqueeze(-1) * {sp.b_full(c['B'])}")

    def step_a(d_t: str) -> str:
        if c["disc"] == "exp_unsqueeze":
            return f"torch.exp({d_t}.unsqueeze(-1) * A)"
        if c["disc"] == "einsum":
            return f"torch.exp(torch.einsum('bd,dn->bdn', {d_t}, A))"
        if c["disc"] == "exp_commuted":
            return f"torch.exp(A * {d_t}.unsqueeze(-1))"
        return f"({d_t}[..., None] * A).exp()"

    def step_b(d_t: str, u_t: str, b_t: str | None) -> str:
        b_src = "B" if c["B"] == "shared" else b_t
        if c["input"] == "einsum":
            sub = {"bnl": "bn", "bln": "bn", "grouped": "bdn", "shared": "dn"}[c["B"]]
            return f"torch.einsum('bd,{sub},bd->bdn', {d_t}, {b_src}, {u_t})"
        bx = b_src if c["B"] in ("grouped", "shared") else f"{b_src}[:, None, :]"
        if c["input"] == "three":
            return f"{d_t}[..., None] * {bx} * {u_t}[..., None]"
        return f"({d_t} * {u_t})[..., None] * {bx}"

    if c["loop"] == "assoc":
        full_terms()
        a_in, b_in = "dA", "dBu"
        if mut == "stale":
            b_in = sp.shifted("dBu")
        if mut == "stale_decay":
            a_in = sp.shifted("dA", "ones")
        if mut == "decay":
            a_in = "0.9 * dA"
        if mut == "in_scale":
            b_in = "0.5 * dBu"
        emit(f"combine = {_COMBINES['order' if mut == 'order' else c['combine']]}")
        emit(f"hs = associative_scan(combine, ({a_in}, {b_in}), dim={tax}, combine_mode='generic')[1]")
        last = "hs[:, :, -1]" if tax == 2 else "hs[:, -1]"
        read = {"tanh": "torch.tanh(hs)", "lagged": sp.shifted("hs"), "sq_readout": "(hs * hs)"}.get(mut, "hs")
        read = f"{read}.to(u.dtype)" if c["cast"] == "yes" else read
        emit(f"y = {'2 * ' if mut == 'out_scale' else ''}{_states_readout(c['readout'], sp, read)}")
    else:
        if c["where"] == "full":
            full_terms()
        state = f"u.shape[0], u.shape[{3 - tax}], A.shape[1]"
        if mut == "init_ones":
            emit(f"h = torch.ones({state}, dtype=u.dtype)")
        elif c["init"] == "zeros":
            emit(f"h = torch.zeros({state}, dtype=u.dtype)")
        elif c["init"] == "zeros_f32":
            emit(f"h = torch.zeros({state})  # float32, promoted to float64 at step 0")
        elif c["init"] == "new_zeros":
            emit(f"h = u.new_zeros(({state}))")
        elif c["init"] == "bcast_zeros":
            # (batch, dim, 1): broadcast over N at step 0.
            emit(f"h = u.new_zeros((u.shape[0], u.shape[{3 - tax}], 1))")
        elif c["where"] == "full":
            emit(f"h = torch.zeros_like({sp.act_t('dA', '0', full=True)})")
        else:
            emit(f"h = torch.zeros_like({step_a(sp.act_t('delta', '0'))})")
        collect = c["collect"]
        emit("ys = u.new_zeros(u.shape)" if collect == "prealloc" else "ys = []")
        loop = c["loop"]
        carry = mut in ("stale", "stale_decay") and loop == "zip"
        if carry:
            emit("prev = None")
        if mut == "mid_state":
            emit("h_mid = None")

        # The loop header, and the step's a_t, b_t, c_t, u_t, z_t.
        u_t = z_t = None
        if loop == "while":
            emit("t = 1" if mut == "first_step" else "t = 0")
            emit(f"while t < {L}:")
        if loop == "range":
            emit({"first_step": f"for t in range(1, {L}):", "prefix": f"for t in range({L} - 1):"}.get(
                mut, f"for t in range({L}):"))
        if loop in ("range", "while"):
            tb = "t - 1" if mut == "stale" else "t"      # the input term's step
            ta = "t - 1" if mut == "stale_decay" else "t"  # the decay's step
            if c["where"] == "full":
                a_t, b_t = sp.act_t("dA", ta, full=True), sp.act_t("dBu", tb, full=True)
            else:
                b_sl = None if c["B"] == "shared" else sp.bc_t("B", c["B"], "t")
                a_t = step_a(sp.act_t("delta", ta))
                b_t = step_b(sp.act_t("delta", "t"), sp.act_t("u", tb), b_sl)
            c_t = sp.bc_t("C", c["C"], f"{L} - 1 - t" if mut == "c_reversed" else "t")
            u_t, z_t = sp.act_t("u", "t"), sp.act_t("z", "t")
        else:
            names, srcs = [], []
            if c["where"] == "full":
                names += ["a_t", "b_t"]
                srcs += [sp.act_unbind("dA"), sp.act_unbind("dBu")]
            if c["where"] == "step" or c["skip"] == "in_loop":
                names += ["d_t", "u_t"]
                srcs += [sp.act_unbind("delta"), sp.act_unbind("u")]
            if c["where"] == "step" and c["B"] != "shared":
                names.append("B_t")
                srcs.append(sp.bc_unbind("B", c["B"]))
            names.append("c_t")
            srcs.append(sp.bc_unbind("C", c["C"]))
            if c["gate"] == "in_loop":
                names.append("z_t")
                srcs.append(sp.act_unbind("z"))
            zipped = f"zip({', '.join(srcs)})"
            if loop == "enumerate":
                emit(f"for t, ({', '.join(names)}) in enumerate({zipped}):")
            else:
                emit(f"for {', '.join(names)} in {zipped}:")
            u_t, z_t, c_t = "u_t", "z_t", "c_t"
            if c["where"] == "full":
                a_t, b_t = "a_t", "b_t"
                if loop == "enumerate" and mut == "stale":
                    b_t = sp.act_t("dBu", "t - 1", full=True)
                if loop == "enumerate" and mut == "stale_decay":
                    a_t = sp.act_t("dA", "t - 1", full=True)
            else:
                b_sl = None if c["B"] == "shared" else "B_t"
                a_t, b_t = step_a("d_t"), step_b("d_t", "u_t", b_sl)
                if loop == "enumerate" and mut == "stale":
                    b_t = step_b("d_t", sp.act_t("u", "t - 1"), b_sl)
                if loop == "enumerate" and mut == "stale_decay":
                    a_t = step_a(sp.act_t("delta", "t - 1"))

        body: list[str] = []
        put = body.append
        if carry:
            # The previous iteration's term (none at step 0: zero input, or decay 1).
            now = b_t if mut == "stale" else a_t
            put(f"now = {now}")
            carried = f"(torch.{'zeros' if mut == 'stale' else 'ones'}_like(now) if prev is None else prev)"
            if mut == "stale":
                b_t = carried
            else:
                a_t = carried
        if mut == "reset":
            put(f"if t == {L} // 2:")
            put("    h = torch.zeros_like(h)")
        a_x = f"0.9 * {a_t}" if mut == "decay" else a_t
        b_x = f"0.5 * {b_t}" if mut == "in_scale" else b_t
        if mut in ("lagged", "half_state"):
            put("h_prev = h")
        if mut == "half_state":
            put(f"h_half = {a_x} * h")
        upd = {"a_h": [f"h = {a_x} * h + {b_x}"], "h_a": [f"h = h * {a_x} + {b_x}"],
               "addcmul": [f"h = torch.addcmul({b_x}, {a_x}, h)"],
               "method": [f"h = h.mul({a_x}).add({b_x})"]}[c["update"]]
        if mut == "tanh":
            upd.append("h = torch.tanh(h)")
        if mut == "freeze":
            put(f"if t != {L} // 2:")
            body.extend("    " + line for line in upd)
        else:
            body.extend(upd)
        if carry:
            put("prev = now")
        if mut == "mid_state":
            put(f"if t == {L} // 2:")
            put("    h_mid = h")
        read = {"lagged": "h_prev", "half_state": "h_half", "sq_readout": "(h * h)"}.get(mut, "h")
        read_y = f"{read}.to(u.dtype)" if c["cast"] == "yes" else read
        if collect == "states":
            put(f"ys.append({read})" if mut != "sq_readout" else "ys.append(h * h)")
        else:
            y_t = _step_readout(c["readout"], read_y, c_t)
            if mut == "out_scale":
                y_t = f"2 * {y_t}"
            if mut == "state_leak":
                y_t = f"{y_t} + 0.1 * {read_y}.mean(-1)"
            if c["skip"] == "in_loop":
                y_t = f"({y_t} + D * {u_t})"
            if c["gate"] == "in_loop":
                y_t = f"{y_t} * F.silu({z_t})"
            if collect == "cat":
                put(f"ys.append(({y_t}).unsqueeze({y_dim}))")
            elif collect == "prealloc":
                put(sp.write_t("ys", "t", y_t))
            else:
                put(f"ys.append({y_t})")
        if loop == "while":
            put("t += 1")
        lines.extend("    " + line for line in body)

        if mut == "first_step":
            # Step 0 written out before the loop.
            if c["where"] == "full":
                b0 = sp.act_t("dBu", "0", full=True)
            else:
                b0 = step_b(sp.act_t("delta", "0"), sp.act_t("u", "0"),
                            None if c["B"] == "shared" else sp.bc_t("B", c["B"], "0"))
            first = [f"h = {b0}"]
            if collect == "states":
                first.append("ys.append(h)")
            else:
                y0 = _step_readout(c["readout"], "h", sp.bc_t("C", c["C"], "0"))
                if c["skip"] == "in_loop":
                    y0 = f"({y0} + D * {sp.act_t('u', '0')})"
                if c["gate"] == "in_loop":
                    y0 = f"{y0} * F.silu({sp.act_t('z', '0')})"
                first.append({"cat": f"ys.append(({y0}).unsqueeze({y_dim}))",
                              "prealloc": sp.write_t("ys", "0", y0)}.get(collect, f"ys.append({y0})"))
            at = next(i for i, line in enumerate(lines) if line.startswith(("for ", "while ")))
            lines[at:at] = first

        ys = "ys[::-1]" if mut == "reversed_collect" else "ys"
        if collect == "states":
            emit(f"hs = torch.stack({ys}, dim={hs_dim})")
            hs = "hs.to(u.dtype)" if c["cast"] == "yes" else "hs"
            emit(f"y = {'2 * ' if mut == 'out_scale' else ''}{_states_readout(c['readout'], sp, hs)}")
        else:
            emit({"cat": f"y = torch.cat({ys}, dim={y_dim})", "stack": f"y = torch.stack({ys}, dim={y_dim})",
                  "prealloc": "y = ys"}[collect])
        last = "h_mid" if mut == "mid_state" else "h"

    if c["calls"] == "twice":
        # The scan as a local function, run forwards and then over the time-flipped inputs (a
        # Vision-Mamba-style bidirectional block): two scans in one graph.
        core = lines[core_start:]
        del lines[core_start:]
        zarg = ", z" if c["gate"] == "in_loop" else ""
        emit(f"def _scan(u, delta, B, C{zarg}):")
        lines.extend("    " + line for line in core)
        emit(f"    return y, {last}")
        emit(f"y, h = _scan(u, delta, B, C{zarg})")
        b_ax = {"bnl": 2, "bln": 1, "grouped": 3}.get(c["B"])
        c_ax = {"bnl": 2, "bln": 1}[c["C"]]
        flipped = [f"u.flip({tax})", f"delta.flip({tax})", "B" if b_ax is None else f"B.flip({b_ax})",
                   f"C.flip({c_ax})"] + ([f"z.flip({tax})"] if zarg else [])
        emit(f"y_back, _ = _scan({', '.join(flipped)})")
        emit(f"y = y + y_back.flip({tax})")
        last = "h"

    # Epilogue: back to the io layout, then the tail in the op's order (skip, then gate).
    if transposed:
        emit("y = y.transpose(1, 2)")
    u_io = "x" if transposed else "u"
    if c["skip"] in ("u_D", "D_u"):
        u_skip = f"{u_io}.roll(1, {2 if c['io'] == 'bdl' else 1})" if mut == "skip_shift" else u_io
        d_b = "D[:, None]" if c["io"] == "bdl" else "D"
        emit(f"y = y + {u_skip} * {d_b}" if c["skip"] == "u_D" else f"y = y + {d_b} * {u_skip}")
    if c["gate"] == "silu":
        emit("y = y * F.silu(z)")
    elif c["gate"] == "sigmoid":
        emit("y = y * (z * torch.sigmoid(z))")
    emit(f"return y, {last}" if c["ret"] != "y" else "return y")

    src = (
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch._higher_order_ops.associative_scan import associative_scan\n\n\n"
        f"def scan_program({', '.join(args)}):\n" + textwrap.indent("\n".join(lines), "    ") + "\n"
    )
    return src, tuple(args)


# --- drawing ----------------------------------------------------------------------------------

def generate(seed: int, mutation_rate: float = 0.5, grad_every: int = 3) -> Program:
    """One program: the mutation (with probability ``mutation_rate``) first, since it limits the
    loops; then every spelling choice independently, fixed up only where two choices can't be
    combined (each fix-up says why)."""
    rng = random.Random(seed)
    d, n, L = rng.randint(3, 5), rng.randint(2, 4), rng.randint(4, 7)
    mut = rng.choice(NEAR_MISSES + STILL_SCANS + EITHER) if rng.random() < mutation_rate else None
    loop = rng.choice(MUTATION_LOOPS[mut] if mut else ALL_LOOPS)
    c = {
        "io": rng.choice(("bdl", "bld")),
        "layout": rng.choice(("bdl", "bld")),
        "A": rng.choice(("A", "A_log")),
        "B": rng.choice(("bnl", "bln", "grouped", "shared")),
        "C": rng.choice(("bnl", "bln")),
        "disc": rng.choice(("exp_unsqueeze", "exp_commuted", "einsum", "method_exp")),
        "input": rng.choice(("broadcast", "three", "einsum")),
        "where": rng.choice(("full", "step")),
        "loop": loop,
        "slice": rng.choice(("index", "select", "ellipsis")),
        "combine": rng.choice(("hf", "swapped", "addcmul")),
        "update": rng.choice(("a_h", "h_a", "addcmul", "method")),
        "init": rng.choice(INITS),
        "readout": rng.choice(READOUTS),
        "collect": rng.choice(("stack", "cat", "prealloc", "states")),
        "softplus": rng.choice(("no", "yes")),
        "skip": rng.choice(("no", "u_D", "D_u", "in_loop")),
        "gate": rng.choice(("no", "silu", "sigmoid", "in_loop")),
        "cast": rng.choice(("no", "yes")),
        "neg_dims": rng.choice(("no", "yes")),
        "store": rng.choice(("contiguous", "transposed")),
        "calls": rng.choice(("once", "once", "twice")),
        "ret": rng.choice(("y", "y_h")),
        "BC": rng.choice(("separate", "same")),
    }
    if c["B"] == "grouped":
        c["G"] = str(rng.choice([g for g in range(1, d) if d % g == 0]))
    # Fix-ups: choices that can't be combined.
    if loop == "assoc":
        # associative_scan takes the full terms and reads all the states out at once: the
        # per-step choices don't exist there.
        c["where"] = "full"
        for k in ("slice", "update", "init", "collect"):
            del c[k]
    else:
        del c["combine"]
        if c["collect"] == "prealloc" and loop == "zip":
            c["collect"] = "stack"   # a write at index t needs t
        if loop == "zip":
            del c["slice"]
    per_step_y = loop != "assoc" and c["collect"] != "states"
    if not per_step_y:
        # Only a per-step y has a y_t to add D*u_t to or to gate.
        c["skip"] = "u_D" if c["skip"] == "in_loop" else c["skip"]
        c["gate"] = "silu" if c["gate"] == "in_loop" else c["gate"]
    if mut == "skip_shift" and c["skip"] in ("no", "in_loop"):
        c["skip"] = "u_D"            # the shifted skip is the one after the loop
    if mut == "reversed_collect" and c.get("collect") == "prealloc":
        c["collect"] = "stack"       # a buffer is written in time order
    if mut == "lagged" and c.get("init") in ("zeros_f32", "bcast_zeros"):
        # The first readout would read the initial zeros themselves: einsum and bmm refuse mixed
        # dtypes and a (batch, dim, 1) state in eager.
        c["init"] = "zeros"
    if mut in ("c_reversed", "state_leak") and c.get("collect") == "states":
        c["collect"] = "stack"       # these change the per-step readout, which "states" doesn't have
    if mut == "mid_state":
        c["ret"] = "y_h"             # the leaked middle state is returned in place of the last
        c["calls"] = "once"          # a second call's middle state would be dead code
    if mut == "prefix":
        # L - 1 outputs: a tail after the loop would need u[..., :L-1]; the states' readout
        # would need C's first L - 1 steps.
        c["skip"] = "no" if c["skip"] != "in_loop" else "in_loop"
        c["gate"] = "no" if c["gate"] != "in_loop" else "in_loop"
        c["collect"] = "stack" if c["collect"] == "states" else c["collect"]
    if c["B"] != c["C"]:
        c["BC"] = "separate"         # one tensor passed as both B and C needs one shape
    src, args = _render(c, mut)
    return Program(seed, (2, d, n, L), c, mut, src, args, grads=seed % grad_every == 0)
