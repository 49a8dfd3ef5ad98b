"""The tensor-parallel step message (engine/step_wire.py): a HostBatch survives the int64 round
trip field for field, and a malformed message is a ValueError naming the field (no pickle)."""
from __future__ import annotations

import numpy as np
import pytest

from polychip.engine import step_wire
from polychip.engine.model_runner import HostBatch


def batch(decodes: bool) -> HostBatch:
    i = np.arange
    host = HostBatch(i(10, 17), i(0, 7), i(100, 107), np.array([4, 6]), [(0, 5, 5, np.array([3])), (5, 2, 9, i(7, 9))])
    if decodes:
        host.decode_pages, host.decode_lens = np.array([[1, 2, 0], [4, 5, 6]]), np.array([20, 40])
    return host


@pytest.mark.parametrize("decodes", [False, True])
def test_round_trip(decodes):
    want = batch(decodes)
    got = step_wire.decode(step_wire.encode(want))
    for name in ("input_ids", "positions", "slot_mapping", "sample_rows", "decode_pages", "decode_lens"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or (a.dtype == np.int64 and np.array_equal(a, b)), name
    assert [(s, q, k, p.tolist()) for s, q, k, p in got.prefills] == \
        [(s, q, k, p.tolist()) for s, q, k, p in want.prefills]


def test_malformed_messages_name_the_field():
    msg = step_wire.encode(batch(True))
    with pytest.raises(ValueError, match="decode_lens needs 2 values"):
        step_wire.decode(msg[:-1])
    with pytest.raises(ValueError, match="1 values after the last field"):
        step_wire.decode(np.append(msg, 0))
    bad = msg.copy()
    bad[0] = 99
    with pytest.raises(ValueError, match="format version 99"):
        step_wire.decode(bad)
    bad = msg.copy()
    bad[1] = -3
    with pytest.raises(ValueError, match="input_ids needs -3 values"):
        step_wire.decode(bad)
