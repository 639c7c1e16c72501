"""Differential fuzzing of the scan passes: seeded Mamba-1 programs, compiled against eager.

``_fuzz_programs.generate(seed)`` draws a selective-scan program from a grammar of spellings that
are all the textbook Mamba-1 scan (discretisation, input term, loop form, readout, collection,
layout, tails: the grammar is documented at the top of that module), sometimes with one mutation.
Each program runs eagerly in fp64 and through the ``ssm`` backend, and the test checks:

(a) exactness: the compiled outputs equal eager's (fp64, rtol/atol 1e-10), and so do the
    gradients of every input for every third seed; every ``INDUCTOR_EVERY``-th seed is also
    compiled with ``backend="ssm"`` and inductor, the way users call it;
(b) a program without a mutation is rewritten: one ``ssm.selective_scan`` per scan in the graph
    after the passes, and every tail fold that applies to it (Δ's softplus, a skip or a gate
    after the loop) is folded into the op;
(c) a near-miss mutation (a program that is no selective scan of its inputs) is left alone, and
    explain gives a reason; a near-miss of the skip leaves the skip unfolded.

Mutations that are still scans (an initial state made in the function, a scale on the input term
or on the readout) must be exact, and rewritten where the passes support them; a scan put to
another use (outputs collected in reverse, a prefix loop, a time-reversed C) must be exact, rewritten
or not. Correct spellings the passes leave alone, with explain's reason
(``_fuzz_programs.UNSUPPORTED`` and the comments at the top of that module):

- step 0 written out before ``range(1, L)`` (``h = dBu[:, :, 0]``): "the loop's first state is
  itself a time slice ...: that equals a scan from h = 0 only where exp(Δ·A) at t = 0 is finite",
  or, discretised in the step, "the state update at step 0 reads its inputs at time index 1, not
  0". Drawn (mutation ``first_step``), exactness checked, rewrite not required.
- a constant factor on the input term (``h = a*h + 0.5*b``): "the state's addend is not a product
  Δ·B·u" (scan_loop), "B_full is not a product Δ·B·u (found 1 factors)" (scan_assoc). Drawn
  (mutation ``in_scale``), rewrite not required.
- ``h = a*h; h += b``: "the state update uses an op that is not an elementwise add/mul (in-place
  iadd)". Not drawn.
- all the states returned besides y: "the states are used by output, which is neither a readout
  Σ_n h·C nor the last state" (by design: the op never materialises them). Not drawn.
- a time flip of an expanded grouped B: the flipped copy is read per channel (G = dim), and next to a
  C shared by the channels, under grad, "B is per channel (batch, dim, N, L) and C is shared by the
  channels, with gradients recorded". Not drawn (the grammar flips the grouped B before expanding it).
- A skip or gate written inside the loop is not folded (the user's per-step code stays after the
  op's y_t); a skip after the loop then follows a gated y, a gate after the loop follows y + D·u,
  and neither folds either. Not asserted.

A seed that found a bug stays in every run (``REGRESSION_SEEDS``).

Run more seeds by hand: ``SSM_FUZZ_SEEDS=500 python3 -m pytest -q -p no:cacheprovider
tests/test_fuzz_scan.py -n 2`` (``SSM_FUZZ_FIRST_SEED`` moves the window). A failure's id names
the seed and every choice; its message holds the program's source, which runs as it is.
"""
import os

import pytest
import torch
from _fuzz_programs import TAIL_NEAR_MISSES, Program, generate
from torch._dynamo.utils import counters

from ssm_compile.report import explain

FIRST_SEED = int(os.environ.get("SSM_FUZZ_FIRST_SEED", "0"))
N_SEEDS = int(os.environ.get("SSM_FUZZ_SEEDS", "150"))
INDUCTOR_EVERY = int(os.environ.get("SSM_FUZZ_INDUCTOR_EVERY", "10"))

# Seeds that found a bug stay in the default run, whatever the window. 249: associative_scan states
# read through a no-op .to(u.dtype) while the last state is used, under grad, were left alone
# (fixed in passes/readout.py, run 48).
REGRESSION_SEEDS = (249,)
SEEDS = sorted(set(range(FIRST_SEED, FIRST_SEED + N_SEEDS)) | set(REGRESSION_SEEDS))
PROGRAMS = [pytest.param(program, id=program.id) for program in map(generate, SEEDS)]
# Miss families that explain a left-alone scan.
SCAN_FAMILIES = {"scan_loop", "scan_assoc", "scan", "discretization", "readout"}


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def _grads(outs, args, weights):
    """d(Σ w·out)/d(inputs), one fixed random weight per output element."""
    return torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), args)


def _assert_exact(program: Program, got, want, args, grads_want, weights, what: str):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")
    if grads_want is not None:
        for name, g_got, g_want in zip(program.arg_names, _grads(got, args, weights), grads_want):
            torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, name=name: f"{what}, gradient of {name}: {m}")


def _expected_folds(program: Program) -> set[str]:
    """The tail folds a rewritten single scan must get: Δ's softplus (but see the associative_scan
    case below); a skip after the loop unless the gate is applied inside it or the readout is
    scaled (then y isn't the op's y); a gate after the loop unless the skip is added inside it or
    the readout is scaled."""
    c = program.choice
    if c["calls"] != "once" or program.mutation not in (None, "init_ones"):
        return set()
    folds = {"delta"} if c["softplus"] == "yes" else set()
    if c["loop"] == "assoc" and c["A"] != "A_log":
        # An associative_scan's first state is B_full[t=0] itself. With A passed in, the graph does
        # not show exp(Δ·A) at t = 0 finite, so the op gets Δ with Δ[t=0] = 0 (a copy the softplus
        # is not folded through) and B_full[t=0] as its initial state (scan_assoc._first_decay_bounded).
        folds.discard("delta")
    if c["skip"] in ("u_D", "D_u") and c["gate"] != "in_loop":
        folds.add("skip")
    if c["gate"] in ("silu", "sigmoid") and c["skip"] != "in_loop":
        folds.add("gate")
    return folds


@pytest.mark.parametrize("program", PROGRAMS)
def test_fuzzed_scan_program(program: Program):
    fn, args = program.function(), program.inputs()
    want = _flat(fn(*args))
    weights = [torch.randn(w.shape, dtype=w.dtype, generator=torch.Generator().manual_seed(program.seed))
               for w in want]
    grads_want = _grads(want, args, weights) if program.grads else None

    # explain compiles with the ssm backend (its passes, the rewritten graph run eagerly) and runs
    # the compiled function once: its output is the compiled one.
    report = explain(fn, *args)
    scans = sum(g.after.count("torch.ops.ssm.selective_scan") for g in report.graphs)
    b, d, n, L = program.shape
    context = (f"\n--- program (seed {program.seed}, mutation {program.mutation}) ---\n{program.source}"
               f"--- inputs: tests/_fuzz_programs.py generate({program.seed}).inputs(), fp64, batch {b}, dim {d}, "
               f"N {n}, L {L}, requires_grad={program.grads} ---\n"
               f"--- explain ---\n{report.format(graphs=False)}")
    try:
        _assert_exact(program, _flat(report.output), want, args, grads_want, weights, "ssm backend")
    except AssertionError as e:
        raise AssertionError(f"{e}{context}") from None

    expect = program.expect_rewrite
    n_scans = 2 if program.choice["calls"] == "twice" else 1
    if expect:
        assert scans == n_scans, f"expected {n_scans} ssm.selective_scan, found {scans}{context}"
        missing = _expected_folds(program) - set(report.counts)
        assert not missing, f"tail folds missing: {sorted(missing)}{context}"
    elif expect is False:
        assert scans == 0, f"a near-miss ({program.mutation}) was rewritten{context}"
        reasons = [m.reason for m in report.misses if m.family in SCAN_FAMILIES and m.reason.strip()]
        assert reasons, f"a near-miss ({program.mutation}) was left alone without a reason{context}"
    if program.mutation in TAIL_NEAR_MISSES:
        assert "skip" not in report.counts, f"a time-shifted skip was folded into the op's D{context}"
        # Explained where the skip follows the op's y directly (not a gated y, not a sum of scans).
        if program.choice["gate"] != "in_loop" and program.choice["calls"] == "once":
            assert any(m.family == "skip" and m.reason.strip() for m in report.misses), \
                f"the shifted skip is not explained{context}"

    if INDUCTOR_EVERY and program.seed % INDUCTOR_EVERY == 0:
        # The user's call: backend="ssm", the rewritten graph compiled by inductor.
        torch._dynamo.reset()
        counters.clear()
        got = _flat(torch.compile(fn, backend="ssm")(*args))
        try:
            _assert_exact(program, got, want, args, grads_want, weights, 'backend="ssm" with inductor')
        except AssertionError as e:
            raise AssertionError(f"{e}{context}") from None
        if expect is not None:
            assert (counters["ssm"]["scan_loop"] + counters["ssm"]["scan_assoc"] > 0) == expect, context
