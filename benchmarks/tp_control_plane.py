"""Step time of tp=2 on the CPU, and the cost of one step broadcast: pickle (before) vs the int64
step message (after, engine/step_wire.py). Run from a checkout:

    PYTHONPATH=<tree>:<tree>/plugins/simxpu python benchmarks/tp_control_plane.py e2e MODEL_DIR
    PYTHONPATH=<tree> python benchmarks/tp_control_plane.py micro

``e2e`` prints the mean wall time of one greedy step of 8 sequences (runs in whichever tree is on
PYTHONPATH, so the same command measures before and after); ``micro`` broadcasts one 8-sequence
decode step and one 512-token prefill step 2000 times each way between two gloo ranks.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import time

import numpy as np


def e2e(model: str) -> None:
    from polychip import LLM, SamplingParams
    spec = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "specs", "cpu-2.yaml")
    llm = LLM(model, device="cpu", device_config=spec, tp_size=2, dtype="float32", max_total_tokens=4096)
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # warm
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        times.append((time.perf_counter() - t0) / 64)
    llm.shutdown()
    print(json.dumps({"step_ms_best": min(times) * 1000, "step_ms_all": [t * 1000 for t in times],
                      "first_tokens": outs[0].outputs[0].token_ids[:8]}))


def _batch(tokens: int, decodes: int):
    from polychip.engine.model_runner import HostBatch
    i = np.arange
    if decodes:
        return HostBatch(i(decodes), i(decodes) + 100, i(decodes) + 1000, i(decodes), [],
                         np.arange(decodes * 8).reshape(decodes, 8), i(decodes) + 100)
    return HostBatch(i(tokens), i(tokens), i(tokens), np.array([tokens - 1]), [(0, tokens, tokens, i(tokens // 16))])


def _rank(rank: int, store_path: str, q) -> None:
    import torch
    import torch.distributed as dist
    from polychip.distributed.communicator import Communicator
    from polychip.engine import step_wire
    comm = Communicator("gloo", rank, 2, dist.FileStore(store_path, 2), timeout_s=60, plugin_name="cpu")
    res = {}
    for label, batch in (("decode x8", _batch(0, 8)), ("prefill 512", _batch(512, 0))):
        for way in ("pickle", "int64"):
            n = 2000
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                if way == "pickle":       # what Communicator.broadcast_object did
                    if rank == 0:
                        data = pickle.dumps(batch)
                        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=comm.control)
                        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=comm.control)
                    else:
                        size = torch.empty(1, dtype=torch.int64)
                        dist.broadcast(size, src=0, group=comm.control)
                        payload = torch.empty(int(size.item()), dtype=torch.uint8)
                        dist.broadcast(payload, src=0, group=comm.control)
                        pickle.loads(payload.numpy().tobytes())
                else:
                    if rank == 0:
                        comm.broadcast_ints(step_wire.encode(batch))
                    else:
                        step_wire.decode(comm.broadcast_ints())
            res[f"{label} {way} us"] = (time.perf_counter() - t0) / n * 1e6
    comm.close()
    q.put((rank, res))


def micro() -> None:
    import tempfile
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="trust-bench-"), "store")
    procs = [ctx.Process(target=_rank, args=(r, store, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    print(json.dumps({"rank1 (receiver)": got[1], "rank0 (sender)": got[0]}, indent=1))


if __name__ == "__main__":
    e2e(sys.argv[2]) if sys.argv[1] == "e2e" else micro()
