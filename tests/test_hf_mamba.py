"""End to end: unmodified HF ``MambaForCausalLM`` under ``torch.compile(backend="ssm")``.

Every Mamba piece of every layer must be rewritten (the counters say so) and the logits must
match eager. Tiny random configs keep inductor's CPU compile short.
"""
import copy

import pytest
import torch
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters
from utils import TOL, rel_err

transformers = pytest.importorskip("transformers", reason="the HF end-to-end tests need transformers")
from transformers import MambaConfig, MambaForCausalLM  # noqa: E402

from ssm_compile.config import SSMOptions  # noqa: E402
from ssm_compile.passes import build_pass_manager  # noqa: E402
from ssm_compile.passes.fx_utils import normalized_graph_str  # noqa: E402

TRANSFORMERS_VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])

VOCAB = 64
# HF's mamba_selective_scan calls lru_cache'd feature probes; dynamo's warning about them is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def tiny_model(hidden=16, layers=1, state=4, rank=4, use_bias=False, use_conv_bias=True, assoc=False,
               dtype=torch.float32):
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=hidden, state_size=state, num_hidden_layers=layers,
                         time_step_rank=rank, conv_kernel=4, use_bias=use_bias, use_conv_bias=use_conv_bias,
                         use_associative_scan=assoc)
    model = MambaForCausalLM(config).eval()
    # HF initialises some weights (conv bias, D) to constants; random ones make every term count.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.to(dtype)


def expected_counts(layers, assoc):
    scan = "scan_assoc" if assoc else "scan_loop"
    families = ("conv1d", scan, "discretization", "readout", "delta", "skip", "gate", "x_dt_proj")
    return {family: layers for family in families}


CONFIGS = {
    "H16-layers1-N4-R4-loop-bias": dict(hidden=16, layers=1, state=4, rank=4, use_bias=True, assoc=False, seq=8),
    "H32-layers2-N8-Rauto-assoc": dict(hidden=32, layers=2, state=8, rank="auto", assoc=True, seq=16),
    "H16-layers2-N8-R2-loop-noconvbias": dict(hidden=16, layers=2, state=8, rank=2, use_bias=True,
                                              use_conv_bias=False, assoc=False, seq=11),
    "H24-layers1-N6-R3-assoc-nobias": dict(hidden=24, layers=1, state=6, rank=3, use_conv_bias=False,
                                           assoc=True, seq=13),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_matches_eager_and_every_piece_is_rewritten(name):
    cfg = dict(CONFIGS[name])
    seq = cfg.pop("seq")
    model = tiny_model(**cfg)
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        out = torch.compile(model, backend="ssm")(ids, use_cache=False).logits
    assert dict(counters["ssm"]) == expected_counts(cfg["layers"], cfg["assoc"])
    assert counters["stats"]["unique_graphs"] == 1, "the model should compile as one graph"
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_bf16_model_within_tolerance_of_fp64():
    model = tiny_model(hidden=16, layers=2, state=8, rank=2, assoc=False, dtype=torch.bfloat16)
    reference = copy.deepcopy(model).double()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = reference(ids, use_cache=False).logits
        eager = model(ids, use_cache=False).logits
        out = torch.compile(model, backend="ssm")(ids, use_cache=False).logits
    # HF upcasts the logits to fp32 whatever the model dtype; the compiled model must too.
    assert out.dtype == eager.dtype
    assert dict(counters["ssm"]) == expected_counts(2, assoc=False)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
    assert rel_err(out, ref) <= 2 * max(rel_err(eager, ref), TOL[torch.float32])


def test_bf16_model_hands_the_scan_its_bf16_D():
    """HF passes ``D=self.D.float()``; on a bf16 model that cast was a kernel per layer on every
    forward. The op widens D itself, so after the rewrites it reads the bf16 parameter."""
    from ssm_compile.kernels import register_ops
    from ssm_compile.passes.fx_utils import dtype_of

    model = tiny_model(hidden=16, layers=2, state=8, rank=2, assoc=False, dtype=torch.bfloat16)
    seen = []

    def backend(gm, example_inputs):
        register_ops()
        build_pass_manager(SSMOptions())(gm)
        seen.extend(n for n in gm.graph.nodes if n.target is torch.ops.ssm.selective_scan.default)
        return gm.forward

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids, use_cache=False)
    assert len(seen) == 2
    for scan in seen:
        D = scan.args[5]
        assert D.op == "placeholder" and dtype_of(D) == torch.bfloat16, scan.format_node()


class CaptureRewritten:
    """Runs the full pass manager (as the backend does) and keeps the normalised rewritten graph."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from ssm_compile.kernels import register_ops

        register_ops()
        build_pass_manager(SSMOptions())(gm)
        self.graphs.append(normalized_graph_str(gm, with_meta=True))
        return gm.forward


def rewritten_mixer_graph(assoc):
    model = tiny_model(hidden=16, layers=1, state=4, rank=2, use_bias=True, assoc=assoc)
    mixer = model.backbone.layers[0].mixer
    hidden = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    capture = CaptureRewritten()
    with torch.no_grad():
        out = torch.compile(mixer, backend=capture, fullgraph=True)(hidden)
        assert rel_err(out, mixer(hidden)) <= TOL[torch.float32]
    (graph,) = capture.graphs
    return graph


def test_snapshot_of_rewritten_mixer_loop():
    graph = rewritten_mixer_graph(assoc=False)
    if TRANSFORMERS_VERSION >= (5, 25):
        # 5.25 computes A = -exp(A_log) in mamba_scan_forward, after x_proj: the same ops, A's
        # three nodes later. (Its split of every scan input at L, and its cat of the one
        # output, are gone before the rewrites: passes/pieces.py.)
        assert_expected_inline(graph, """\
%L_args_0_ = placeholder  # float32[2, 8, 16]
%L_self_modules_conv1d_parameters_bias_ = placeholder  # float32[32]
%L_self_modules_conv1d_parameters_weight_ = placeholder  # float32[32, 1, 4]
%L_self_modules_dt_proj_parameters_bias_ = placeholder  # float32[32]
%L_self_modules_dt_proj_parameters_weight_ = placeholder  # float32[32, 2]
%L_self_modules_in_proj_parameters_bias_ = placeholder  # float32[64]
%L_self_modules_in_proj_parameters_weight_ = placeholder  # float32[64, 16]
%L_self_modules_out_proj_parameters_bias_ = placeholder  # float32[16]
%L_self_modules_out_proj_parameters_weight_ = placeholder  # float32[16, 32]
%L_self_modules_x_proj_parameters_weight_ = placeholder  # float32[10, 32]
%L_self_parameters_A_log_ = placeholder  # float32[32, 4]
%L_self_parameters_D_ = placeholder  # float32[32]
%linear_1 = torch._C._nn.linear(%L_args_0_, %L_self_modules_in_proj_parameters_weight_, %L_self_modules_in_proj_parameters_bias_)  # float32[2, 8, 64]
%transpose_1 = .transpose(%linear_1, 1, 2)  # float32[2, 64, 8]
%chunk_1 = .chunk(%transpose_1, 2, 1)  # (float32[2, 32, 8], float32[2, 32, 8])
%getitem_1 = operator.getitem(%chunk_1, 0)  # float32[2, 32, 8]
%getitem_2 = operator.getitem(%chunk_1, 1)  # float32[2, 32, 8]
%squeeze_1 = .squeeze(%L_self_modules_conv1d_parameters_weight_, 1)  # float32[32, 4]
%causal_conv1d_1 = torch.ops.ssm.causal_conv1d.default(%getitem_1, %squeeze_1, %L_self_modules_conv1d_parameters_bias_, 'silu')  # float32[2, 32, 8]
%transpose_2 = .transpose(%causal_conv1d_1, 1, 2)  # float32[2, 8, 32]
%x_dt_proj_1 = torch.ops.ssm.x_dt_proj.default(%transpose_2, %L_self_modules_x_proj_parameters_weight_, %L_self_modules_dt_proj_parameters_weight_)  # (float32[2, 8, 10], float32[2, 8, 32])
%getitem_3 = operator.getitem(%x_dt_proj_1, 0)  # float32[2, 8, 10]
%getitem_4 = operator.getitem(%x_dt_proj_1, 1)  # float32[2, 8, 32]
%split_1 = torch.functional.split(%getitem_3, [2, 4, 4], -1)  # (float32[2, 8, 2], float32[2, 8, 4], float32[2, 8, 4])
%getitem_5 = operator.getitem(%split_1, 1)  # float32[2, 8, 4]
%getitem_6 = operator.getitem(%split_1, 2)  # float32[2, 8, 4]
%exp_1 = torch.exp(%L_self_parameters_A_log_)  # float32[32, 4]
%neg_1 = operator.neg(%exp_1)  # float32[32, 4]
%permute_1 = .permute(%getitem_6, (0, 2, 1))  # float32[2, 4, 8]
%permute_2 = .permute(%getitem_5, (0, 2, 1))  # float32[2, 4, 8]
%transpose_3 = .transpose(%getitem_4, -1, -2)  # float32[2, 32, 8]
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%causal_conv1d_1, %transpose_3, %neg_1, %permute_2, %permute_1, %L_self_parameters_D_, %getitem_2, %L_self_modules_dt_proj_parameters_bias_, True, None, False)  # (float32[2, 32, 8], float32[0])
%getitem_7 = operator.getitem(%selective_scan_1, 0)  # float32[2, 32, 8]
%transpose_4 = .transpose(%getitem_7, 1, 2)  # float32[2, 8, 32]
%linear_2 = torch._C._nn.linear(%transpose_4, %L_self_modules_out_proj_parameters_weight_, %L_self_modules_out_proj_parameters_bias_)  # float32[2, 8, 16]
return (%linear_2,)
""")
    else:
        assert_expected_inline(graph, """\
%L_args_0_ = placeholder  # float32[2, 8, 16]
%L_self_modules_conv1d_parameters_bias_ = placeholder  # float32[32]
%L_self_modules_conv1d_parameters_weight_ = placeholder  # float32[32, 1, 4]
%L_self_modules_dt_proj_parameters_bias_ = placeholder  # float32[32]
%L_self_modules_dt_proj_parameters_weight_ = placeholder  # float32[32, 2]
%L_self_modules_in_proj_parameters_bias_ = placeholder  # float32[64]
%L_self_modules_in_proj_parameters_weight_ = placeholder  # float32[64, 16]
%L_self_modules_out_proj_parameters_bias_ = placeholder  # float32[16]
%L_self_modules_out_proj_parameters_weight_ = placeholder  # float32[16, 32]
%L_self_modules_x_proj_parameters_weight_ = placeholder  # float32[10, 32]
%L_self_parameters_A_log_ = placeholder  # float32[32, 4]
%L_self_parameters_D_ = placeholder  # float32[32]
%linear_1 = torch._C._nn.linear(%L_args_0_, %L_self_modules_in_proj_parameters_weight_, %L_self_modules_in_proj_parameters_bias_)  # float32[2, 8, 64]
%transpose_1 = .transpose(%linear_1, 1, 2)  # float32[2, 64, 8]
%exp_1 = torch.exp(%L_self_parameters_A_log_)  # float32[32, 4]
%neg_1 = operator.neg(%exp_1)  # float32[32, 4]
%chunk_1 = .chunk(%transpose_1, 2, 1)  # (float32[2, 32, 8], float32[2, 32, 8])
%getitem_1 = operator.getitem(%chunk_1, 0)  # float32[2, 32, 8]
%getitem_2 = operator.getitem(%chunk_1, 1)  # float32[2, 32, 8]
%squeeze_1 = .squeeze(%L_self_modules_conv1d_parameters_weight_, 1)  # float32[32, 4]
%causal_conv1d_1 = torch.ops.ssm.causal_conv1d.default(%getitem_1, %squeeze_1, %L_self_modules_conv1d_parameters_bias_, 'silu')  # float32[2, 32, 8]
%transpose_2 = .transpose(%causal_conv1d_1, 1, 2)  # float32[2, 8, 32]
%x_dt_proj_1 = torch.ops.ssm.x_dt_proj.default(%transpose_2, %L_self_modules_x_proj_parameters_weight_, %L_self_modules_dt_proj_parameters_weight_)  # (float32[2, 8, 10], float32[2, 8, 32])
%getitem_3 = operator.getitem(%x_dt_proj_1, 0)  # float32[2, 8, 10]
%getitem_4 = operator.getitem(%x_dt_proj_1, 1)  # float32[2, 8, 32]
%split_1 = torch.functional.split(%getitem_3, [2, 4, 4], -1)  # (float32[2, 8, 2], float32[2, 8, 4], float32[2, 8, 4])
%getitem_5 = operator.getitem(%split_1, 1)  # float32[2, 8, 4]
%getitem_6 = operator.getitem(%split_1, 2)  # float32[2, 8, 4]
%permute_1 = .permute(%getitem_6, (0, 2, 1))  # float32[2, 4, 8]
%permute_2 = .permute(%getitem_5, (0, 2, 1))  # float32[2, 4, 8]
%transpose_3 = .transpose(%getitem_4, -1, -2)  # float32[2, 32, 8]
%selective_scan_1 = torch.ops.ssm.selective_scan.default(%causal_conv1d_1, %transpose_3, %neg_1, %permute_2, %permute_1, %L_self_parameters_D_, %getitem_2, %L_self_modules_dt_proj_parameters_bias_, True, None, False)  # (float32[2, 32, 8], float32[0])
%getitem_7 = operator.getitem(%selective_scan_1, 0)  # float32[2, 32, 8]
%transpose_4 = .transpose(%getitem_7, 1, 2)  # float32[2, 8, 32]
%linear_2 = torch._C._nn.linear(%transpose_4, %L_self_modules_out_proj_parameters_weight_, %L_self_modules_out_proj_parameters_bias_)  # float32[2, 8, 16]
return (%linear_2,)
""")


def test_assoc_mixer_rewrites_to_the_loop_mixers_graph():
    # HF's associative_scan branch and its loop branch compute one function; after the rewrites
    # they are one graph (the loop one's snapshot is above).
    assert rewritten_mixer_graph(assoc=True) == rewritten_mixer_graph(assoc=False)


def test_partial_rewrite_keeps_the_inlined_associative_scan_runnable():
    # Only conv1d rewrites; HF's associative_scan stays as dynamo inlined it, functorch
    # bookkeeping (_vmap_increment_nesting, _add_batch_dim, ...) included. Cleaning up after the
    # conv rewrite must not drop those "unused" calls: the graph would fail at run time.
    from ssm_compile.compiler import backend

    model = tiny_model(hidden=16, layers=1, state=4, rank=2, assoc=True)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = torch.compile(model, backend=backend(inductor=False, passes=("conv1d",)))(ids, use_cache=False).logits
        ref = model(ids, use_cache=False).logits
    assert dict(counters["ssm"]) == {"conv1d": 1}
    assert rel_err(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("assoc", [False, True], ids=["loop", "assoc"])
def test_new_sequence_length_recompiles_and_still_rewrites(assoc):
    # The second length makes dynamo recompile (the loop form specialises on L; the
    # associative_scan form comes back with a symbolic L): both graphs must be rewritten. The
    # rewritten graphs run eagerly to keep this test fast; the rewrites are the same.
    from ssm_compile.compiler import backend

    model = tiny_model(hidden=16, layers=1, state=4, rank=2, assoc=assoc)
    compiled = torch.compile(model, backend=backend(inductor=False))
    with torch.no_grad():
        for seq in (8, 12):
            ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
            assert rel_err(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits) <= TOL[torch.float32]
    assert dict(counters["ssm"]) == {family: 2 for family in expected_counts(1, assoc)}


@pytest.mark.parametrize("assoc", [False, True], ids=["loop", "assoc"])
def test_prefill_with_cache_fills_the_same_states(assoc):
    # With a cache, the prefill scan also returns its last state (return_last_state=True) and
    # the conv input is recorded in the cache: both must match eager.
    from ssm_compile.compiler import backend

    model = tiny_model(hidden=16, layers=1, state=4, rank=2, assoc=assoc)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = torch.compile(model, backend=backend(inductor=False))(ids, use_cache=True)
        ref = model(ids, use_cache=True)
    assert dict(counters["ssm"]) == expected_counts(1, assoc)
    assert rel_err(out.logits, ref.logits) <= TOL[torch.float32]
    (state, conv), (state_ref, conv_ref) = layer_states(out), layer_states(ref)
    assert rel_err(state, state_ref) <= TOL[torch.float32]
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)


def layer_states(output, layer=0):
    """(recurrent state, conv state) of ``layer`` in the cache an HF output carries: ``cache``
    with getters in the 5.2x releases, ``cache_params.layers[i]``'s lists in 5.17 (the H200's)."""
    cache = getattr(output, "cache", None) or output.cache_params
    if hasattr(cache, "get_recurrent_state"):
        return cache.get_recurrent_state(layer), cache.get_conv_state(layer)
    entry = cache.layers[layer]
    return entry.recurrent_states[0], entry.conv_states[0]


def test_decode_step_is_rewritten_without_prefill_near_misses():
    # HF's decode step convolves torch.cat([conv_state, x]) unpadded and runs a one-step scan
    # "loop"; the decode pass rewrites both. Neither is a near-miss of the prefill passes (an
    # unpadded conv is no causal-conv candidate). The products of the step's other one-step
    # slices (dt's, B's) are no scan candidates either: only an exp decay makes a one-step
    # "loop" worth a miss (before, one was reported for them).
    from ssm_compile import explain

    model = tiny_model(hidden=16, layers=1, state=4, rank=2)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        prefill = model(ids, use_cache=True)
        cache = getattr(prefill, "cache", None) or prefill.cache_params
        step_ref = model(ids[:, -1:], cache_params=copy.deepcopy(cache), use_cache=True,
                         cache_position=torch.tensor([6])).logits
        report = explain(lambda tok, c: model(tok, cache_params=c, use_cache=True,
                                              cache_position=torch.tensor([6])).logits,
                         ids[:, -1:], copy.deepcopy(cache))
    assert sorted(r.family for r in report.rewrites) == ["conv_update", "state_update"]
    assert report.misses == []
    assert rel_err(report.output, step_ref) <= TOL[torch.float32]
