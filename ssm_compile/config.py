"""Options of the ``ssm`` backend, validated once when the backend is configured.

``ssm_compile.backend(**options)`` and ``torch.compile(m, backend="ssm", options={...})`` both
end up here, so a typo fails with a message naming the option instead of being silently ignored:
at once for ``ssm_compile.backend``, at the first compile for ``torch.compile``'s ``mode`` and
``options``, which torch hands to the backend only then.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# The pass modules in the order the pass manager runs them. conv1d goes first so the scan
# passes see the conv as one op; delta and tail fold into the scan op the scan passes emit;
# xproj then strips copies on the way into those ops; fuse merges conv / dt_proj into the
# scan where the heuristic says it pays; decode handles the single-step graphs; logits has the
# LM head's matmul write its float32 logits itself (passes/logits.py; it changes rounding, so
# it is the one pass a user may want off: disable=("logits",)).
PASS_NAMES = ("conv1d", "scan_loop", "scan_assoc", "delta", "tail", "xproj", "fuse", "x_dt_proj", "decode", "logits")

# "auto": the heuristic (ssm_compile/heuristic.py) decides per call site among the levels the
# H200 sweep found worth keeping; "split": keep each recognised piece its own op (also useful
# to bisect a numerical difference); "fused": the deepest legal level that fits the register
# budget; "level1" / "dt" / "level2": that level wherever it is legal
# (kernels/fused/triton_fused.py describes what each level fuses).
FUSE_MODES = ("auto", "split", "fused", "level1", "dt", "level2")


@dataclasses.dataclass(frozen=True)
class SSMOptions:
    """Validated options of one configured backend.

    Args:
        fuse: one of ``FUSE_MODES``; recorded in every pass's ``ctx.options["fuse"]``.
        passes: the pass modules to run (names from ``PASS_NAMES``); ``None`` means all.
        disable: pass modules to skip, applied after ``passes``.
        inductor: hand the rewritten graph to inductor (``True``) or run it eagerly (``False``,
            which keeps the ssm ops but nothing else is compiled: useful for debugging).
        mode: an inductor mode (``"reduce-overhead"`` turns on CUDA graphs, e.g. for decode).
        inductor_config: inductor config patches, applied on top of ``mode``'s.
        inline_launches: on CUDA, hand the Triton launches of the decode ops, of the
            forwards of ``causal_conv1d`` and ``selective_scan`` and of ``x_dt_proj`` (its
            kernel, or its two matmuls where the op would run those) to inductor's generated
            code (``kernels/inline.py``);
            ``False`` keeps each op whole, with its own dispatch and launcher (to compare, or to
            bisect).
        cpp_wrapper: inductor's C++ wrapper (the generated code launches the kernels from C++
            instead of Python). ``None`` (auto) turns it on for a rewritten inference graph
            (no backward) with CUDA inputs unless CUDA graphs are asked for (with inductor's
            graph partition, the default, the C++ wrapper would turn them off), and otherwise
            leaves inductor's own setting alone: launched from Python, the 130m forward at
            batch 8, L=512 is host-bound, and the C++ wrapper halves its time (run 27), and
            batch-1 decode runs 1.8x faster (run 28), for a cold compile of 104 s instead of
            35 s (run 28; benchmarks/RESULTS.md). Training graphs are left alone: see
            ``compiler._auto_cpp_wrapper``. A compile that fails with auto's choice is retried
            without it. ``True`` / ``False``: on / off for every graph.
    """

    fuse: str = "auto"
    passes: tuple[str, ...] | None = None
    disable: frozenset[str] = frozenset()
    inductor: bool = True
    mode: str | None = None
    # Left out of the hash (a dict isn't hashable) but not out of equality.
    inductor_config: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    inline_launches: bool = True
    cpp_wrapper: bool | None = None

    def __post_init__(self) -> None:
        if self.fuse not in FUSE_MODES:
            raise ValueError(f"ssm backend option 'fuse' must be one of {FUSE_MODES}, got {self.fuse!r}")
        if self.passes is not None:
            object.__setattr__(self, "passes", tuple(_check_pass_names("passes", self.passes)))
        object.__setattr__(self, "disable", frozenset(_check_pass_names("disable", self.disable)))
        for name in ("inductor", "inline_launches"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ssm backend option {name!r} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.mode is not None:
            _check_mode(self.mode)
            if not self.inductor:
                raise ValueError(f"ssm backend option 'mode'={self.mode!r} needs inductor=True")
        if not isinstance(self.inductor_config, Mapping):
            raise TypeError("ssm backend option 'inductor_config' must be a dict of inductor config patches, "
                            f"got {type(self.inductor_config).__name__}")
        _check_inductor_config(self.inductor_config)
        if self.cpp_wrapper is not None and not isinstance(self.cpp_wrapper, bool):
            raise TypeError(f"ssm backend option 'cpp_wrapper' must be None (auto) or a bool, "
                            f"got {type(self.cpp_wrapper).__name__}")
        if "cpp_wrapper" in self.inductor_config:
            # One switch, so that auto never has to guess which of two settings the user meant.
            raise ValueError("set the C++ wrapper with the ssm backend option 'cpp_wrapper', "
                             "not through 'inductor_config'")
        object.__setattr__(self, "inductor_config", dict(self.inductor_config))

    @property
    def enabled_passes(self) -> tuple[str, ...]:
        """The pass modules that run, in pass-manager order."""
        chosen = PASS_NAMES if self.passes is None else self.passes
        return tuple(name for name in PASS_NAMES if name in chosen and name not in self.disable)

    def config_patches(self) -> dict[str, Any]:
        """Inductor config patches: the mode's, then the explicit ones on top, then
        ``cpp_wrapper`` where it is decided (None, auto not yet decided for a graph: no patch)."""
        import torch._inductor

        patches = dict(torch._inductor.list_mode_options(self.mode)) if self.mode else {}
        patches.update(self.inductor_config)
        if self.cpp_wrapper is not None:
            patches["cpp_wrapper"] = self.cpp_wrapper
        return patches

    def pass_options(self) -> dict[str, Any]:
        """What the passes see as ``ctx.options`` (and what the pass manager's uuid hashes)."""
        return {"fuse": self.fuse, "passes": self.enabled_passes}

    @classmethod
    def from_kwargs(cls, mode: str | None = None, options: Mapping[str, Any] | None = None,
                    **kwargs: Any) -> "SSMOptions":
        """Build from ``torch.compile``'s ``mode``/``options`` and/or keyword options.

        ``options`` keys that are not ``SSMOptions`` fields are taken as inductor config patches
        (as ``torch.compile(..., options=...)`` does for inductor), and validated as such.
        """
        return cls(**cls._merged(mode, options, kwargs))

    def with_compile_args(self, mode: str | None, options: Mapping[str, Any] | None) -> "SSMOptions":
        """These options with ``torch.compile``'s ``mode`` and ``options`` on top: a value set
        there wins, and its inductor config patches join ours."""
        merged = self._merged(mode, options, {})
        if "inductor_config" in merged and isinstance(merged["inductor_config"], Mapping):
            merged["inductor_config"] = {**self.inductor_config, **merged["inductor_config"]}
        return dataclasses.replace(self, **merged)

    @classmethod
    def _merged(cls, mode: str | None, options: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if options is not None and not isinstance(options, Mapping):
            raise TypeError(f"ssm backend: 'options' must be a dict, got {type(options).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        merged: dict[str, Any] = {}
        inductor_config: dict[str, Any] = {}
        for key, value in {**(options or {}), **kwargs}.items():
            if key in fields:
                merged[key] = value
            else:
                inductor_config[key] = value
        if inductor_config:
            if not isinstance(merged.get("inductor_config", {}), Mapping):
                raise TypeError("ssm backend option 'inductor_config' must be a dict of inductor config patches, "
                                f"got {type(merged['inductor_config']).__name__}")
            merged["inductor_config"] = {**merged.get("inductor_config", {}), **inductor_config}
        if mode is not None and mode != "default":
            merged["mode"] = mode
        return merged


def _check_pass_names(option: str, names: Any) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"ssm backend option {option!r} must be a collection of pass names, got the string "
                        f"{names!r} (write ({names!r},))")
    try:
        names = list(names)
    except TypeError:
        raise TypeError(f"ssm backend option {option!r} must be a collection of pass names, got "
                        f"{type(names).__name__} {names!r}") from None
    unknown = [n for n in names if n not in PASS_NAMES]
    if unknown:
        raise ValueError(f"ssm backend option {option!r} has unknown pass name(s) {unknown}; "
                         f"expected names from {PASS_NAMES}")
    return names


def _check_mode(mode: str) -> None:
    import torch._inductor

    modes = tuple(torch._inductor.list_mode_options())
    if mode not in modes:
        raise ValueError(f"ssm backend option 'mode' must be one of {modes}, got {mode!r}")


def _check_inductor_config(patches: Mapping[str, Any]) -> None:
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = [k for k in patches if k not in known]
    if unknown:
        raise ValueError(f"unknown ssm backend option(s) {unknown}: they are neither ssm options "
                         f"({[f.name for f in dataclasses.fields(SSMOptions)]}) nor inductor config keys")
    for key, value in patches.items():
        # An on/off switch given a string ("yes") or a number would be read by its truth value.
        if isinstance(known[key], bool) and not isinstance(value, bool):
            raise TypeError(f"inductor config {key!r} (an ssm backend option) must be a bool, got "
                            f"{type(value).__name__} {value!r}")
