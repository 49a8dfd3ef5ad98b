"""Communicator: the backend a plugin names (built-in, a vendor's registered one, an unknown one),
the collectives, and float32 accumulation of bfloat16/float16 sums."""
from __future__ import annotations

import itertools
import os
import queue as queue_mod
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polychip.distributed.collective_check import bus_factor, run_collective_check
from polychip.distributed.communicator import Communicator, check_backend
from polychip.errors import PluginError

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
VENDOR_PLUGIN = os.path.join(HERE, "plugins", "vendor_ccl.py")
WORLD = 4
# per dtype: a large value L whose neighbours L+1 are not representable (bf16: 8 significant bits,
# fp16: 11). Summed in any order and grouping, some arrangement of (L, 1, 1, -L) adds 1 to L first
# and loses it; in float32 every arrangement gives exactly 2.
DRIFT_LARGE = {torch.bfloat16: 256.0, torch.float16: 2048.0}


def test_unknown_backend_names_the_plugin_and_the_backend():
    with pytest.raises(PluginError, match=r"plugin 'mychip' names the collective backend 'nosuchccl', which "
                                          r"torch.distributed does not know") as e:
        check_backend("mychip", "nosuchccl")
    assert "register_backend" in str(e.value) and e.value.layer == "plugin"
    with pytest.raises(PluginError, match="communicator_backend\\(\\) returned None"):
        check_backend("mychip", None)


def test_a_backend_this_torch_build_lacks_is_a_hardware_error():
    if dist.is_backend_available("nccl"):
        assert check_backend("cuda", "nccl") == "nccl"
        return
    with pytest.raises(PluginError, match=r"plugin 'cuda' names the collective backend 'nccl', which this torch "
                                          r"build .* does not include") as e:
        check_backend("cuda", "nccl")
    assert e.value.layer == "hardware"


def test_builtin_plugins_name_their_backends():
    from polychip.devices.cpu import CpuPlugin
    from polychip.devices.cuda import CudaPlugin
    from polychip_simxpu.plugin import SimXpuPlugin
    assert CpuPlugin().communicator_backend() == "gloo"
    assert SimXpuPlugin().communicator_backend() == "gloo"
    assert CudaPlugin().communicator_backend() == "nccl"
    assert check_backend("cpu", "GLOO") == "gloo"


def _rank_main(rank: int, store_path: str, results) -> None:
    try:
        comm = Communicator("gloo", rank, WORLD, dist.FileStore(store_path, WORLD), timeout_s=60, plugin_name="cpu")
        out = {}
        out["sum"] = comm.all_reduce(torch.tensor([float(rank + 1)])).item()
        out["min"] = comm.all_reduce(torch.tensor([float(rank + 1)]), op="min").item()
        out["max"] = comm.all_reduce(torch.tensor([float(rank + 1)]), op="max").item()
        part = torch.full((2, 3), float(rank))
        out["gather0"] = comm.all_gather(part, dim=0).tolist()
        out["gather_last"] = comm.all_gather(part, dim=-1).tolist()
        out["bcast"] = comm.broadcast(torch.tensor([float(rank * 10)]), src=2).item()
        sent = comm.broadcast_ints(np.array([7, 1, 2]) if rank == 1 else None, src=1)
        out["obj"] = sent.tolist()
        out["stop"] = comm.broadcast_ints(None, src=0)
        out["objs"] = comm.all_gather_json({"rank": rank, "name": "x" * rank})
        comm.barrier()
        for dtype, big in DRIFT_LARGE.items():
            vals = [big, 1.0, 1.0, -big]
            # element j holds permutation j of the four values, rank r contributes position r
            perms = list(itertools.permutations(range(WORLD)))
            mine = torch.tensor([vals[p[rank]] for p in perms], dtype=dtype)
            comm.accumulate_fp32 = True
            on = comm.all_reduce(mine.clone())
            comm.accumulate_fp32 = False
            off = comm.all_reduce(mine.clone())
            out[str(dtype)] = (on.float().tolist(), off.float().tolist(), on.dtype == dtype)
        comm.close()
        results.put((rank, out))
    except Exception as e:
        results.put((rank, f"{type(e).__name__}: {e}"))


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path_factory.mktemp("comm") / "store")
    procs = [ctx.Process(target=_rank_main, args=(r, store, results), daemon=True) for r in range(WORLD)]
    got = {}
    try:
        for p in procs:
            p.start()
        while len(got) < WORLD:
            rank, out = results.get(timeout=120)
            got[rank] = out
    except queue_mod.Empty:
        pytest.fail(f"only ranks {sorted(got)} answered within 120s")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    bad = {r: o for r, o in got.items() if isinstance(o, str)}
    assert not bad, bad
    return got


def test_collectives_on_a_group_the_instance_owns(world_results):
    for rank, out in world_results.items():
        assert out["sum"] == 10 and out["min"] == 1 and out["max"] == 4
        assert out["gather0"] == [[float(r)] * 3 for r in range(WORLD) for _ in range(2)]
        assert out["gather_last"] == [[float(r) for r in range(WORLD) for _ in range(3)]] * 2
        assert out["bcast"] == 20.0
        assert out["obj"] == [7, 1, 2] and out["stop"] is None
        assert out["objs"] == [{"rank": r, "name": "x" * r} for r in range(WORLD)]


@pytest.mark.parametrize("dtype", list(DRIFT_LARGE), ids=str)
def test_low_precision_sums_accumulate_in_float32_by_default(world_results, dtype):
    """Exact sum is 2 in every element. Accumulating in float32 (the default) gets it everywhere;
    summing in the tensor's own dtype loses the 1s added to the large value first in some."""
    for rank, out in world_results.items():
        on, off, same_dtype = out[str(dtype)]
        assert same_dtype, "the result keeps the tensor's dtype"
        assert on == [2.0] * len(on), on
        drifted = [v for v in off if v != 2.0]
        assert drifted, "without float32 accumulation some arrangement must lose precision"


def test_a_second_communicator_in_one_process_is_refused(tmp_path):
    store = dist.FileStore(str(tmp_path / "s"), 1)
    comm = Communicator("gloo", 0, 1, store, timeout_s=10, plugin_name="cpu")
    try:
        with pytest.raises(PluginError, match="already initialised in this process"):
            Communicator("gloo", 0, 1, store, timeout_s=10, plugin_name="cpu")
        assert comm.all_reduce(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]
    finally:
        comm.close()
    assert not dist.is_initialized()


def _spec(tmp_path, device_type: str) -> str:
    path = tmp_path / f"{device_type}-2.yaml"
    path.write_text(textwrap.dedent(f"""
        device_type: {device_type}
        device_ids: [0, 1]
        memory:
          total: 1GiB
        supported_dtypes: [float32]
    """))
    return str(path)


def test_a_vendor_backend_registered_with_torch_plugs_in(tmp_path):
    """The plugin's module registers 'vendorccl' with torch.distributed.Backend.register_backend and
    names it; each rank process discovers the plugin, so the backend exists there too."""
    res = run_collective_check("vendorchip", [0, 1], (f"{VENDOR_PLUGIN}:VendorChipPlugin",),
                               _spec(tmp_path, "vendorchip"), nbytes=2**20, iters=2, timeout_s=90)
    assert res.ok, res.lines
    assert res.backend == "vendorccl"
    assert all("vendorccl" in line and "all_reduce sum = 3, expected 3" in line for line in res.lines)
    assert [b.op for b in res.bandwidth] == ["all_reduce", "all_gather"]
    for b in res.bandwidth:
        assert b.seconds > 0 and b.busbw == pytest.approx(b.algbw * bus_factor(b.op, 2))


def test_a_plugin_naming_an_unknown_backend_fails_clearly(tmp_path):
    res = run_collective_check("nobackendchip", [0, 1], (f"{VENDOR_PLUGIN}:UnknownBackendPlugin",),
                               _spec(tmp_path, "nobackendchip"), nbytes=2**20, iters=1, timeout_s=90)
    assert not res.ok
    assert any("plugin 'nobackendchip' names the collective backend 'nosuchccl'" in line for line in res.lines)


def test_bus_bandwidth_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 2) == 0.5 and bus_factor("all_gather", 8) == 7 / 8
