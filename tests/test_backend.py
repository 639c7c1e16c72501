"""The ``ssm`` backend: entry point, option validation, the uuid that feeds inductor's caches."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from utils import TOL, rel_err

from ssm_compile.compiler import SSMBackend, backend
from ssm_compile.config import PASS_NAMES, SSMOptions
from ssm_compile.passes import build_pass_manager


def conv_silu(x, w, b):
    return F.silu(F.conv1d(x, w, b, padding=w.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]])


def conv_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 6, 9, generator=g), torch.randn(6, 1, 4, generator=g) / 4, torch.randn(6, generator=g)


def test_entry_point_in_fresh_process_without_importing_us():
    # backend="ssm" must resolve through the torch_dynamo_backends entry point alone, and the
    # graph it compiles must go through our passes and then inductor.
    script = textwrap.dedent("""
        import sys
        import torch
        import torch.nn.functional as F
        from torch._dynamo.utils import counters

        assert "ssm_compile" not in sys.modules
        def f(x, w, b):
            return F.silu(F.conv1d(x, w, b, padding=3, groups=6)[..., :x.shape[-1]]) * 2
        x, w, b = torch.randn(2, 6, 9), torch.randn(6, 1, 4), torch.randn(6)
        out = torch.compile(f, backend="ssm")(x, w, b)
        torch.testing.assert_close(out, f(x, w, b), rtol=1e-5, atol=1e-5)
        assert "ssm_compile.compiler" in sys.modules
        assert counters["ssm"]["conv1d"] == 1, dict(counters["ssm"])
        assert counters["inductor"], "inductor did not compile the rewritten graph"
        print("OK")
    """)
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            cwd="/", timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]


def test_eager_backend_runs_rewritten_graph():
    x, w, b = conv_inputs()
    out = torch.compile(conv_silu, backend=backend(inductor=False))(x, w, b)
    assert counters["ssm"]["conv1d"] == 1 and not counters["inductor"]
    assert rel_err(out, conv_silu(x, w, b)) <= TOL[torch.float32]


def test_disabled_pass_does_not_rewrite():
    x, w, b = conv_inputs()
    out = torch.compile(conv_silu, backend=backend(inductor=False, disable={"conv1d"}))(x, w, b)
    assert counters["ssm"]["conv1d"] == 0
    torch.testing.assert_close(out, conv_silu(x, w, b), rtol=0, atol=0)


def test_torch_compile_options_reach_the_backend():
    # torch.compile(backend="ssm", options=...) passes options to ssm_backend as a keyword.
    x, w, b = conv_inputs()
    out = torch.compile(conv_silu, backend="ssm", options={"inductor": False, "passes": ("xproj",)})(x, w, b)
    assert counters["ssm"]["conv1d"] == 0 and not counters["inductor"]
    torch.testing.assert_close(out, conv_silu(x, w, b), rtol=0, atol=0)


def test_torch_compile_mode_and_options_apply_on_top_of_a_configured_backend():
    """``torch.compile(m, backend=ssm_compile.backend(...), mode=..., options=...)``: torch hands
    its mode and options to the backend object at each compile, as it does to ``ssm_backend``;
    they raised TypeError at the first call before."""
    opts = SSMOptions(fuse="split", inductor_config={"max_autotune": False, "freezing": False})
    merged = opts.with_compile_args("max-autotune-no-cudagraphs", {"passes": ("conv1d",), "freezing": True})
    assert merged.fuse == "split" and merged.mode == "max-autotune-no-cudagraphs"
    assert merged.enabled_passes == ("conv1d",)
    assert merged.inductor_config == {"max_autotune": False, "freezing": True}
    assert opts.with_compile_args("default", None) == opts
    with pytest.raises(ValueError, match="'fuse' must be one of"):
        opts.with_compile_args(None, {"fuse": "nope"})
    with pytest.raises(TypeError, match="'inductor_config' must be a dict"):
        opts.with_compile_args(None, {"inductor_config": "x"})

    x, w, b = conv_inputs()
    records = []
    configured = SSMBackend(SSMOptions(disable=frozenset({"logits"})), on_graph=records.append)
    out = torch.compile(conv_silu, backend=configured, options={"inductor": False, "passes": ("xproj",)})(x, w, b)
    assert counters["ssm"]["conv1d"] == 0 and not counters["inductor"] and len(records) == 1
    torch.testing.assert_close(out, conv_silu(x, w, b), rtol=0, atol=0)
    torch._dynamo.reset()
    out = torch.compile(conv_silu, backend=backend(fuse="split"), mode="max-autotune-no-cudagraphs")(x, w, b)
    assert counters["ssm"]["conv1d"] == 1
    assert rel_err(out, conv_silu(x, w, b)) <= TOL[torch.float32]


def test_package_backend_factory_after_the_entry_point_imported_us():
    # The entry point imports ssm_compile.compiler; the package's `backend` must stay the factory.
    import ssm_compile.compiler  # noqa: F401

    configured = ssm_compile.backend(fuse="split")
    assert isinstance(configured, SSMBackend) and configured.options.fuse == "split"


def test_options_defaults_and_ordering():
    opts = SSMOptions()
    assert opts.enabled_passes == PASS_NAMES and opts.inductor and opts.fuse == "auto"
    assert SSMOptions(passes=("xproj", "conv1d"), disable={"xproj"}).enabled_passes == ("conv1d",)
    assert SSMOptions.from_kwargs(mode="reduce-overhead").config_patches() == {"triton.cudagraphs": True}
    opts = SSMOptions.from_kwargs(options={"fuse": "fused", "max_autotune": True})
    assert opts.fuse == "fused" and opts.config_patches() == {"max_autotune": True}


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"fuse": "always"}, ValueError, "'fuse' must be one of"),
    ({"passes": ("conv1d", "nope")}, ValueError, "'passes' has unknown pass name(s) ['nope']"),
    ({"disable": "conv1d"}, TypeError, "'disable' must be a collection of pass names"),
    ({"inductor": "yes"}, TypeError, "'inductor' must be a bool"),
    ({"mode": "fastest"}, ValueError, "'mode' must be one of"),
    ({"mode": "reduce-overhead", "inductor": False}, ValueError, "needs inductor=True"),
    ({"not_an_option": 1}, ValueError, "unknown ssm backend option(s) ['not_an_option']"),
    ({"inductor_config": [("max_autotune", True)]}, TypeError, "'inductor_config' must be a dict"),
    ({"cpp_wrapper": "auto"}, TypeError, "'cpp_wrapper' must be None (auto) or a bool"),
    ({"inductor_config": {"cpp_wrapper": True}}, ValueError, "with the ssm backend option 'cpp_wrapper'"),
    ({"passes": 42}, TypeError, "'passes' must be a collection of pass names, got int 42"),
    ({"disable": None}, TypeError, "'disable' must be a collection of pass names, got NoneType None"),
    ({"max_autotune": "yes"}, TypeError, "inductor config 'max_autotune' (an ssm backend option) must be a bool"),
    ({"inductor_config": "x", "max_autotune": False}, TypeError, "'inductor_config' must be a dict"),
], ids=["fuse", "passes", "disable-str", "inductor-type", "mode", "mode-without-inductor", "unknown-key",
        "inductor_config-type", "cpp_wrapper-type", "cpp_wrapper-as-inductor-config", "passes-not-iterable",
        "disable-none", "inductor-switch-type", "inductor_config-type-with-patches"])
def test_option_validation(kwargs, exc, message):
    with pytest.raises(exc) as info:
        backend(**kwargs)
    assert message in str(info.value)


def test_uuid_tracks_options_and_passes():
    base = build_pass_manager(SSMOptions(passes=("conv1d",)))
    assert base.uuid() == build_pass_manager(SSMOptions(passes=("conv1d",))).uuid()
    assert base.uuid() != build_pass_manager(SSMOptions(passes=("conv1d",), fuse="split")).uuid()
    assert base.uuid() != build_pass_manager(SSMOptions(passes=("conv1d", "xproj"))).uuid()
    assert base.uuid() != build_pass_manager(SSMOptions(passes=("xproj",))).uuid()


def test_uuid_reaches_inductor_cache_key():
    from torch._inductor.codecache import FxGraphHashDetails
    from torch._inductor.custom_graph_pass import CustomGraphPass

    configured = backend(passes=("conv1d",))
    pm = configured.pass_manager()
    patches = configured.config_patches(pm, configured.options)
    key_pass = patches["post_grad_custom_post_pass"]
    assert isinstance(key_pass, CustomGraphPass) and key_pass.uuid() == pm.uuid()
    # What inductor's FX graph cache hashes for this config slot is our uuid (the helper's name
    # differs across torch versions).
    detail = (getattr(FxGraphHashDetails, "_get_custom_pass_detail_unsafe", None)
              or FxGraphHashDetails._get_custom_pass_detail)
    assert detail(None, key_pass) == pm.uuid()

    class Inner(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "inner"

    assert pm.cache_key_pass(Inner()).uuid() == (pm.uuid(), "inner")
    assert pm.cache_key_pass(lambda graph: None).uuid() is None


# --- the xproj pass, through the backend ----------------------------------------------------

R, N = 2, 4


def mamba_ssm_style_split(x, u, w_x, A, *, keep_b_copy=False, mutate_source=False):
    """mamba_ssm's Mamba.forward layout work: split x_proj, rearrange B/C and make them contiguous."""
    batch, dim, length = u.shape
    x_dbl = F.linear(x.reshape(batch * length, dim), w_x)
    dt, B, C = torch.split(x_dbl, [R, N, N], dim=-1)
    B = B.reshape(batch, length, N).transpose(1, 2).contiguous()
    C = C.reshape(batch, length, N).permute(0, 2, 1).clone()
    if mutate_source:
        x_dbl.mul_(2.0)
    delta = F.softplus(dt.sum(-1)).reshape(batch, 1, length).expand(batch, dim, length)
    y, _ = torch.ops.ssm.selective_scan(u, delta, A, B, C)
    return (y, B) if keep_b_copy else y


def split_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 5, 6, generator=g), torch.randn(2, 6, 5, generator=g),
            torch.randn(R + 2 * N, 6, generator=g) / 3, -torch.rand(6, N, generator=g) - 0.1)


def run_xproj(fn, *args):
    from ssm_compile.kernels import register_ops

    register_ops()
    records = []
    configured = SSMBackend(SSMOptions(inductor=False, passes=("xproj",)), on_graph=records.append)
    out = torch.compile(fn, backend=configured, fullgraph=True)(*args)
    return records[0], out


def test_xproj_removes_copies_between_split_and_op():
    record, out = run_xproj(mamba_ssm_style_split, *split_inputs())
    assert counters["ssm"]["x_proj_split"] == 2
    assert sorted(r.decision["arg"] for r in record.rewrites) == ["B", "C"]
    assert ".contiguous()" not in record.after and ".clone()" not in record.after
    assert rel_err(out, mamba_ssm_style_split(*split_inputs())) <= TOL[torch.float32]


def test_xproj_keeps_a_copy_with_another_user():
    fn = lambda *a: mamba_ssm_style_split(*a, keep_b_copy=True)  # noqa: E731
    record, out = run_xproj(fn, *split_inputs())
    assert [r.decision["arg"] for r in record.rewrites] == ["C"]
    assert any(m.reason.startswith("B: a copy") for m in record.misses), record.misses
    assert ".contiguous()" in record.after
    torch.testing.assert_close(out, fn(*split_inputs()), rtol=0, atol=0)


def test_xproj_keeps_copies_when_the_source_is_mutated():
    fn = lambda *a: mamba_ssm_style_split(*a, mutate_source=True)  # noqa: E731
    record, out = run_xproj(fn, *split_inputs())
    assert counters["ssm"]["x_proj_split"] == 0 and len(record.misses) == 2
    assert all("written in place" in m.reason for m in record.misses)
    torch.testing.assert_close(out, fn(*split_inputs()), rtol=0, atol=0)


# --- the pass manager's clean-up ------------------------------------------------------------

def test_cleanup_only_drops_pure_computations():
    import operator

    from torch._functorch.predispatch import _add_batch_dim, _vmap_increment_nesting

    from ssm_compile.passes.manager import _removable_if_unused

    g = torch.fx.Graph()
    x = g.placeholder("x")
    removable = {
        "exp": g.call_function(torch.exp, (x,)),
        "linear": g.call_function(torch._C._nn.linear, (x, x)),
        "transpose": g.call_method("transpose", (x, 0, 1)),
        "add": g.call_function(operator.add, (x, 1)),
        "log_api_usage": g.call_function(torch._C._log_api_usage_once, ("python.nn_module",)),
    }
    kept = {
        "mul_": g.call_method("mul_", (x, 2)),
        "setitem": g.call_function(operator.setitem, (x, 0, 1.0)),
        "iadd": g.call_function(operator.iadd, (x, 1)),
        "out=": g.call_function(torch.exp, (x,), {"out": x}),
        "randn": g.call_function(torch.randn, (3,)),
        "dropout": g.call_function(F.dropout, (x,)),
        "vmap_increment_nesting": g.call_function(_vmap_increment_nesting, (1, "error")),
        "add_batch_dim": g.call_function(_add_batch_dim, (x, 0, 1)),
    }
    assert [k for k, n in removable.items() if not _removable_if_unused(n)] == []
    assert [k for k, n in kept.items() if _removable_if_unused(n)] == []


# --- torch.compiler.is_exporting() under backend="ssm" (ssm_compile.dynamo_compat) -------------

def _branch_on_exporting(x):
    return x + (1.0 if torch.compiler.is_exporting() else 0.0)


@pytest.fixture
def folded_is_exporting(monkeypatch):
    """Recreate torch 2.11's dynamo, which folded is_exporting() to True under torch.compile,
    then let dynamo_compat wrap it as it does on that release."""
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    from ssm_compile import dynamo_compat

    def folded(self, tx, *args, **kwargs):
        return ConstantVariable.create(True)

    monkeypatch.setitem(TorchInGraphFunctionVariable._get_handlers(), torch.compiler.is_exporting, folded)
    torch._dynamo.reset()
    assert torch.compile(_branch_on_exporting, backend="eager")(torch.zeros(())).item() == 1.0, \
        "the simulated torch 2.11 behaviour is not in effect"
    torch._dynamo.reset()
    assert dynamo_compat.install()
    yield
    torch._dynamo.reset()


def test_is_exporting_is_false_under_ssm_and_other_backends_keep_their_torch(folded_is_exporting):
    x = torch.randn(())
    assert torch.equal(torch.compile(_branch_on_exporting, backend="ssm")(x), x + 0.0)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_branch_on_exporting, backend=backend(inductor=False))(x), x + 0.0)
    torch._dynamo.reset()
    # torch.compile's options wrapper around the entry point is seen through as well.
    assert torch.equal(torch.compile(_branch_on_exporting, backend="ssm", options={"fuse": "split"})(x), x + 0.0)
    torch._dynamo.reset()
    # Another backend in the same process still sees its torch's (folded) answer.
    assert torch.equal(torch.compile(_branch_on_exporting, backend="eager")(x), x + 1.0)


def test_is_exporting_wrapper_installs_once():
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    from ssm_compile import dynamo_compat

    assert dynamo_compat.install() and dynamo_compat.install()
    handler = TorchInGraphFunctionVariable._get_handlers()[torch.compiler.is_exporting]
    assert getattr(handler, "_ssm_compile_is_exporting_fix")
    assert not getattr(handler.__wrapped__, "_ssm_compile_is_exporting_fix", False)


def test_hf_mamba_takes_associative_scan_under_folded_is_exporting(folded_is_exporting):
    # On torch 2.11 HF's mamba_selective_scan saw is_exporting() == True and unrolled its loop
    # (compile time growing with L); under backend="ssm" it now takes associative_scan.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=1,
                                   use_associative_scan=True)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 12))
    counters.clear()
    with torch.no_grad():
        out = torch.compile(model, backend="ssm")(ids, use_cache=False).logits
        ref = model(ids, use_cache=False).logits
    assert counters["ssm"]["scan_assoc"] == 1 and counters["ssm"]["scan_loop"] == 0, dict(counters["ssm"])
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("edited_file", ["fx_utils.py", "triton_bwd.py", "compiler.py"])
def test_uuid_hashes_every_source_of_the_package(monkeypatch, edited_file):
    # A change in a shared matcher (no pass registered from it), in a kernel (an op's backward is
    # traced into the cached artifact: probe AW, run 51) or in the compile driver must miss
    # inductor's cache.
    import pathlib

    import ssm_compile.passes.manager as manager

    pm = build_pass_manager(SSMOptions())
    before = pm.uuid()
    real = pathlib.Path.read_bytes

    def edited(path):
        data = real(path)
        return data + b"\n# edited" if path.name == edited_file else data

    monkeypatch.setattr(manager.pathlib.Path, "read_bytes", edited)
    manager._sources_digest.cache_clear()  # read once per process; this test edits the "disk"
    try:
        assert pm.uuid() != before
    finally:
        monkeypatch.undo()
        manager._sources_digest.cache_clear()
    assert pm.uuid() == before


def test_inline_launches_option(monkeypatch):
    """``inline_launches=False`` turns the kernels/inline.py rule off for the compile it wraps
    (through functorch's own flag, which AOTAutograd's cache key includes); the default leaves
    it on. A non-bool is refused by name."""
    from ssm_compile.compiler import _launches_kept_in_ops
    from ssm_compile.kernels import inline

    with pytest.raises(TypeError, match="'inline_launches' must be a bool"):
        backend(inline_launches="no")
    # A call the rule would take: static CUDA tensors (faked here), no interpreter.
    monkeypatch.setattr(inline, "_static_cuda", lambda args: True)
    monkeypatch.setattr(inline, "_interpreted", lambda: False)
    with _launches_kept_in_ops(SSMOptions()):
        assert inline.inlines((), (), {})
    with _launches_kept_in_ops(SSMOptions(inline_launches=False)):
        assert not inline.inlines((), (), {})
    assert inline.inlines((), (), {})


def test_auto_cpp_wrapper_choice():
    """Auto turns the C++ wrapper on for an inference graph with CUDA inputs (faked here: the
    choice reads only the inputs' devices and flags), and leaves it off on the CPU, for a graph
    with a backward, and wherever CUDA graphs are asked for, by mode or by config (it would
    turn them off). An explicit choice reaches inductor's
    patches as it is; auto adds nothing there itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ssm_compile.compiler import _auto_cpp_wrapper

    with FakeTensorMode():
        on_cuda = [torch.empty(2, 3, device="cuda"), 4]
    on_cpu = [torch.empty(2, 3), 4]
    assert _auto_cpp_wrapper(SSMOptions(), on_cuda)
    assert not _auto_cpp_wrapper(SSMOptions(), on_cpu)
    assert not _auto_cpp_wrapper(SSMOptions.from_kwargs(mode="reduce-overhead"), on_cuda)
    assert not _auto_cpp_wrapper(SSMOptions(inductor_config={"triton.cudagraphs": True}), on_cuda)
    assert _auto_cpp_wrapper(SSMOptions.from_kwargs(mode="max-autotune-no-cudagraphs"), on_cuda)
    # A graph AOTAutograd will differentiate keeps the Python wrapper; under no_grad it is
    # an inference graph whatever its inputs' flags.
    with FakeTensorMode():
        trained = [torch.empty(2, 3, device="cuda", requires_grad=True), torch.empty(3, device="cuda")]
    assert not _auto_cpp_wrapper(SSMOptions(), trained)
    with torch.no_grad():
        assert _auto_cpp_wrapper(SSMOptions(), trained)
    configured = backend(cpp_wrapper=False)
    pm = configured.pass_manager()
    assert configured.config_patches(pm, configured.options)["cpp_wrapper"] is False
    assert "cpp_wrapper" not in configured.config_patches(pm, SSMOptions())


def test_auto_cpp_wrapper_leaves_inductors_own_setting(monkeypatch):
    """Where auto says no (a CPU graph here), the compile gets no cpp_wrapper patch, so a user's
    own ``torch._inductor.config.cpp_wrapper`` stands; where it says yes, the patch is True."""
    import torch._inductor.compile_fx as compile_fx_module

    from ssm_compile import compiler

    seen = []

    def record(gm, *a, config_patches=None, **k):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", record)
    x, w, b = conv_inputs()

    torch._dynamo.reset()
    torch.compile(conv_silu, backend="ssm", fullgraph=True)(x, w, b)
    assert "cpp_wrapper" not in seen[0], seen
    monkeypatch.setattr(compiler, "_auto_cpp_wrapper", lambda options, example_inputs: True)
    torch._dynamo.reset()
    torch.compile(conv_silu, backend="ssm", fullgraph=True)(x, w, b)
    assert seen[1]["cpp_wrapper"] is True, seen
    assert SSMOptions.from_kwargs(options={"cpp_wrapper": True}).cpp_wrapper is True


def test_failed_auto_cpp_wrapper_compile_retries_without_it(caplog, monkeypatch):
    """If inductor fails on a rewritten graph with the C++ wrapper that auto chose (a machine
    without a host compiler, say), the backend compiles it again without the wrapper and keeps
    the rewrites; an explicit ``cpp_wrapper=True`` is the user's and is not second-guessed."""
    import logging

    import torch._inductor.compile_fx as compile_fx_module

    from ssm_compile import compiler

    real, calls = compile_fx_module.compile_fx, []

    def fails_with_cpp_wrapper(gm, *a, config_patches=None, **k):
        calls.append((config_patches or {}).get("cpp_wrapper"))
        if calls[-1]:
            raise RuntimeError("no C++ compiler, on purpose")
        return real(gm, *a, config_patches=config_patches, **k)

    monkeypatch.setattr(compiler, "_auto_cpp_wrapper", lambda options, example_inputs: True)
    monkeypatch.setattr(compile_fx_module, "compile_fx", fails_with_cpp_wrapper)
    x, w, b = conv_inputs()
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.WARNING, logger="ssm_compile"):
        y = torch.compile(conv_silu, backend="ssm", fullgraph=True)(x, w, b)
    assert counters["ssm"]["conv1d"] == 1
    # (compile_fx then calls itself once its patches are applied, without patches: the None)
    assert calls[:2] == [True, False], calls
    assert "retrying without it (cpp_wrapper=False)" in caplog.text and "without ssm rewrites" not in caplog.text
    torch.testing.assert_close(y, conv_silu(x, w, b))

    calls.clear()
    torch._dynamo.reset()
    # Forced on, it stays on through the ops-whole retry and the graph without rewrites, so the
    # failure is the user's to see (plain inductor with the C++ wrapper would fail the same).
    with pytest.raises(Exception, match="no C\\+\\+ compiler, on purpose"):
        torch.compile(conv_silu, backend=backend(cpp_wrapper=True), fullgraph=True)(x, w, b)
    assert calls == [True, True, True], calls


def test_failed_inlined_compile_retries_with_the_ops_whole(caplog, monkeypatch):
    """If inductor fails on a graph whose decode ops' launches were inlined, the backend compiles
    it again with the ops whole and keeps the rewrites, instead of dropping them all."""
    import logging

    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx_module

    from ssm_compile.kernels.decode import op as decode_op
    from ssm_compile.kernels.decode.reference import selective_state_update_ref

    real, calls = compile_fx_module.compile_fx, []

    def fails_when_inlined(gm, *a, **k):
        held = any("selective_state_update" in str(n.target) for n in gm.graph.nodes)
        calls.append((held, functorch_config.decompose_custom_triton_ops))
        if held and functorch_config.decompose_custom_triton_ops:
            raise RuntimeError("NameError in a user kernel, on purpose")
        return real(gm, *a, **k)

    def step(state, x, dt, A, B, C, D, z, dt_bias):
        # HF's torch decode step: exp(dt*A)*state + dt*B*x, then the C readout, D skip and gate.
        dt = torch.nn.functional.softplus(dt + dt_bias)
        dA = torch.exp(A[None] * dt[..., None])
        state.copy_(state * dA + (dt * x)[..., None] * B[:, None, :])
        y = (state * C[:, None, :]).sum(-1) + D * x
        return y * torch.nn.functional.silu(z)

    decode_op.register()
    monkeypatch.setattr(compile_fx_module, "compile_fx", fails_when_inlined)
    g = torch.Generator().manual_seed(0)
    b, d, n = 2, 8, 4
    inp = [torch.randn(b, d, n, generator=g), torch.randn(b, d, generator=g), torch.randn(b, d, generator=g),
           -torch.rand(d, n, generator=g) - 0.1, torch.randn(b, n, generator=g), torch.randn(b, n, generator=g),
           torch.randn(d, generator=g), torch.randn(b, d, generator=g), torch.randn(d, generator=g)]
    y_ref, state_ref = selective_state_update_ref(inp[0].clone(), *inp[1:], dt_softplus=True)
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level(logging.WARNING, logger="ssm_compile"):
        y = torch.compile(step, backend="ssm", fullgraph=True)(*inp)
    assert counters["ssm"]["state_update"] == 1
    assert calls[:2] == [(True, True), (True, False)], calls
    assert "retrying with the ops whole" in caplog.text and "without ssm rewrites" not in caplog.text
    assert rel_err(y, y_ref) < TOL[torch.float32] and rel_err(inp[0], state_ref) < TOL[torch.float32]
