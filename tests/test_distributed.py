"""The backend under data parallelism: DDP (with dynamo's DDPOptimizer) and FSDP2.

Both run here in one process (world size 1, gloo, CPU), which is enough for what the backend
sees: DDPOptimizer splits dynamo's graph at gradient-bucket boundaries and hands each piece to
the backend on its own, and FSDP2 wraps each layer in parameter all-gathers. The gradients are
compared against eager on the same model.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@contextlib.contextmanager
def process_group(tmp_path):
    # A file store in the test's own folder: the two xdist workers never share a port.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        # Drain gloo's queue before the group can be freed. DDP's allreduces, issued from the
        # compiled backward, carry Python objects in their thread-local state, which gloo's worker
        # thread releases after running them, under the GIL; if the Reducer dies meanwhile (at the
        # test's return), its thread holds the GIL while it joins that worker, and both wait for
        # ever (seen once in run 42, with py-spy). The barrier's own work carries no such object.
        dist.barrier()
        dist.destroy_process_group()


def tiny_hf(layers=2):
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=41, hidden_size=32, state_size=8, num_hidden_layers=layers, expand=2,
                      conv_kernel=4, time_step_rank=4, use_cache=False)
    torch.manual_seed(0)
    return MambaForCausalLM(cfg)


def grads_of(model, ids, run=None):
    """The loss of one step through ``run`` (default: the model itself) and ``model``'s gradients."""
    out = (model if run is None else run)(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_training_step(got, ref):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        r = ref_grads[name]
        assert (g - r).norm() <= 1e-5 * r.norm() + 1e-8, name


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.001], ids=["one-bucket", "bucket-per-parameter"])
def test_ddp_training_step_matches_eager(tmp_path, bucket_cap_mb, monkeypatch):
    ids = torch.randint(0, 41, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = grads_of(tiny_hf(), ids)
    # DDP's first bucket may not be larger than the others (DDPOptimizer asserts it).
    monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", int(min(bucket_cap_mb, 1) * 1e6))
    with process_group(tmp_path):
        model = tiny_hf()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        got = grads_of(model, ids, run=torch.compile(ddp, backend="ssm"))
    assert_same_training_step(got, ref)
    if bucket_cap_mb == 25:
        # One bucket, so DDPOptimizer hands over the whole graph: every piece of both layers.
        assert counters["ssm"]["scan_assoc"] + counters["ssm"]["scan_loop"] == 2, dict(counters["ssm"])
        assert counters["ssm"]["conv1d"] == 2 and counters["ssm"]["x_dt_proj"] == 2, dict(counters["ssm"])
    else:
        # A split at every parameter cuts each block between its discretisation and its scan,
        # and the backend sees the pieces one by one: what stays whole is still rewritten, the
        # scan is not (README, "Distributed training"), and the answer is eager's.
        assert counters["ssm"]["conv1d"] == 2, dict(counters["ssm"])


def test_fsdp2_training_step_matches_eager(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ids = torch.randint(0, 41, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = grads_of(tiny_hf(), ids)
    with process_group(tmp_path):
        # A CPU mesh: without one, fully_shard moves the model to the GPU where there is one.
        mesh = init_device_mesh("cpu", (1,))
        model = tiny_hf()
        for layer in model.backbone.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss, grads = grads_of(model, ids, run=torch.compile(model, backend="ssm"))
        grads = {n: g.full_tensor() for n, g in grads.items()}
    assert_same_training_step((loss, grads), ref)
    # FSDP2 breaks the graph at each layer; the two layers share one compiled graph.
    assert counters["ssm"]["scan_assoc"] + counters["ssm"]["scan_loop"] >= 1, dict(counters["ssm"])
    assert counters["ssm"]["x_dt_proj"] >= 1 and counters["ssm"]["gate"] >= 1, dict(counters["ssm"])
