"""``examples/generate.py``'s path, as a test: greedy ``generate()`` through ``backend="ssm"`` with a
cache allocated outside compiled code gives eager's tokens; on CUDA the same with
``mode="reduce-overhead"`` (CUDA graphs), the configuration issue 6 asks to work.
"""
import importlib.util
import pathlib

import pytest
import torch
from torch._dynamo.utils import counters

import ssm_compile

pytest.importorskip("transformers", reason="the generation tests need transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")

_spec = importlib.util.spec_from_file_location(
    "generate_example", pathlib.Path(__file__).parents[1] / "examples" / "generate.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

CASES = [
    pytest.param("cpu", "default", id="cpu"),
    pytest.param("cuda", "reduce-overhead", id="cuda-graphs",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("device, mode", CASES)
def test_generate_with_static_cache_matches_eager(device, mode):
    model = example.build_model("tiny", device, torch.float32)
    prompt = torch.randint(1, model.config.vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(0)).to(device)
    eager = example.generate(model, prompt, 6)
    cache = example.static_cache(model, 2)
    model.forward = torch.compile(model.forward, backend=ssm_compile.backend(mode=mode))
    first = example.generate(model, prompt, 6, cache)
    again = example.generate(model, prompt, 6, cache)  # replays (CUDA graphs: recorded by now)
    assert torch.equal(first, eager) and torch.equal(again, eager)
    fired = counters["ssm"]
    assert fired["state_update"] and fired["conv_update"] and fired["scan_assoc"] + fired["scan_loop"]
