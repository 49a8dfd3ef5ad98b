"""The KV hand-off contract between a prefill engine (cpu, page 16) and a decode engine (simxpu, page 4),
in one process, with each backend: reserve, send, ack (greedy tokens as plain serving on the decode
chip; both pools whole afterwards: every page free or cached, the integrity check finding no leak),
refuse at once, abort, both sides' timeouts, a mismatched model refused before any byte moves."""
from __future__ import annotations

import itertools
import time

import pytest

from pd_helpers import GREEDY, Driver, engine, plain_tokens
from polychip.engine.disagg.decode import RemotePrefill
from polychip.errors import KVTransferError
from polychip.http.server import free_port

pytestmark = pytest.mark.device_independent   # names its devices: prefill on cpu, decode on simxpu

TIMEOUT = 3.0        # both sides' transfer timeout here
_ids = itertools.count()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(1000 + 7919 * (i + seed)) % 150000 for i in range(n)]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen3", False, 2)


@pytest.fixture(scope="module")
def reference(model):
    """Plain serving on the decode chip."""
    eng = engine(model, "simxpu")
    yield eng
    eng.shutdown()


def _pair(model, backend: str, prefill_timeout: float = TIMEOUT, decode_timeout: float = TIMEOUT):
    port = free_port("127.0.0.1")
    common = dict(disaggregation_transfer_backend=backend, disaggregation_buffer_mb=4)
    pre = Driver(engine(model, "cpu", disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                        disaggregation_transfer_timeout=prefill_timeout, **common))
    dec = Driver(engine(model, "simxpu", disaggregation_mode="decode", page_size=4,
                        disaggregation_transfer_timeout=decode_timeout, **common))
    return pre, dec, RemotePrefill("127.0.0.1", pre.engine.disagg.agent.bootstrap_port)


@pytest.fixture(scope="module", params=["tcp", "local", "mooncake"])
def pair(request, model):
    if request.param == "mooncake":
        from polychip.engine.disagg.mooncake_backend import unavailable
        if unavailable():
            pytest.skip(unavailable())
    pre, dec, remote = _pair(model, request.param)
    yield pre, dec, remote
    dec.stop()
    pre.stop()


def _submit(dec: Driver, remote, prompt, params=GREEDY) -> str:
    rid = f"r{next(_ids)}"
    dec.call(lambda e: e.add_request(prompt, params, rid, remote=remote))
    return rid


def test_a_handed_off_request_decodes_as_plain_serving_and_both_pools_end_whole(pair, reference, model):
    pre, dec, remote = pair
    before = dict(pre.engine.disagg.status()), dict(dec.engine.disagg.status())
    prompt = _prompt(70)
    out = dec.wait(_submit(dec, remote, prompt))
    assert out.token_ids == plain_tokens(reference, prompt)
    for side in (pre, dec):
        free, cached, total = side.idle_pages()
        assert free + cached == total, (free, cached, total)
    after = pre.engine.disagg.status(), dec.engine.disagg.status()
    mc = reference.model_config
    want = 70 * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4      # float32 on the wire
    for b, a in zip(before, after):
        assert a["transfers_done"] == b["transfers_done"] + 1 and a["transfers_failed"] == b["transfers_failed"]
        assert a["bytes"] - b["bytes"] == want and a["transfers_in_flight"] == 0


def test_the_decode_side_refuses_at_once_when_it_cannot_reserve(pair):
    pre, dec, remote = pair
    started = pre.engine.disagg.status()["transfers_started"]
    pre.paused.set()                            # the prefill side takes nothing meanwhile
    try:
        holders = [_submit(dec, remote, _prompt(1000, s)) for s in (1, 2)]      # 500 of 512 pages reserved
        free = dec.call(lambda e: e.pages.num_free)
        with pytest.raises(KVTransferError, match="cannot reserve 25 KV pages"):
            _submit(dec, remote, _prompt(100, 3))
        assert dec.call(lambda e: e.pages.num_free) == free         # nothing taken by the refusal
        for rid in holders:
            dec.call(lambda e, rid=rid: e.abort(rid))
    finally:
        pre.paused.clear()
        pre.wake()
    assert dec.idle_pages()[0] + dec.idle_pages()[1] == dec.idle_pages()[2]
    assert pre.idle_pages()[0] + pre.idle_pages()[1] == pre.idle_pages()[2]
    assert pre.engine.disagg.status()["transfers_started"] <= started + 2      # never asked for the refused one


def test_an_abort_mid_transfer_frees_both_sides(pair):
    pre, dec, remote = pair
    pre.paused.set()
    started = pre.engine.disagg.status()["transfers_started"]
    rid = _submit(dec, remote, _prompt(200, 4))
    deadline = time.monotonic() + 10
    while pre.engine.disagg.status()["transfers_started"] == started and time.monotonic() < deadline:
        time.sleep(0.01)                        # the prefill side has the request, not yet computed
    assert dec.call(lambda e: e.abort(rid) and e.scheduler.find(rid) is None)     # gone, its pages back
    pre.paused.clear()
    pre.wake()
    for side in (pre, dec):
        free, cached, total = side.idle_pages()
        assert free + cached == total
    assert pre.engine.disagg.status()["transfers_in_flight"] == 0


@pytest.fixture(scope="module")
def tcp_pair(model):
    """The decode side gives up first (its request), as it should."""
    pre, dec, remote = _pair(model, "tcp", prefill_timeout=60)
    yield pre, dec, remote
    dec.stop()
    pre.stop()


def test_a_silent_prefill_side_times_out_and_the_decode_side_serves_it_plainly(tcp_pair, reference, caplog):
    pre, dec, remote = tcp_pair
    fallbacks = dec.engine.disagg.status()["fallbacks"]
    prompt = _prompt(60, 5)
    pre.paused.set()
    try:
        out = dec.wait(_submit(dec, remote, prompt), timeout=TIMEOUT + 20)
    finally:
        pre.paused.clear()
        pre.wake()
    assert out.token_ids == plain_tokens(reference, prompt)
    assert dec.engine.disagg.status()["fallbacks"] == fallbacks + 1
    assert any("no KV within the deadline" in r.getMessage() and "prefill 127.0.0.1:" in r.getMessage()
               for r in caplog.records)
    for side in (pre, dec):
        free, cached, total = side.idle_pages()
        assert free + cached == total


def test_a_decode_side_that_never_acks_is_timed_out_by_the_prefill_side(model, reference, caplog):
    pre, dec, remote = _pair(model, "tcp", decode_timeout=60)      # only the prefill side's clock runs out
    try:
        _never_acked(pre, dec, remote, reference, caplog)
    finally:
        dec.stop()
        pre.stop()


def _never_acked(pre, dec, remote, reference, caplog):
    failed = pre.engine.disagg.status()["transfers_failed"]
    prompt = _prompt(80, 6)
    rid = _submit(dec, remote, prompt)
    dec.paused.set()                  # chunks arrive; nothing is written, so no ack
    time.sleep(TIMEOUT + 1.5)
    assert pre.engine.disagg.status()["transfers_failed"] == failed + 1
    assert pre.idle_pages()[0] + pre.idle_pages()[1] == pre.idle_pages()[2]      # freed without the ack
    dec.paused.clear()
    dec.wake()
    assert dec.wait(rid).token_ids == plain_tokens(reference, prompt)            # prefilled on the decode side
    assert any("no ack within the deadline" in r.getMessage() and "decode" in r.getMessage()
               for r in caplog.records)
    free, cached, total = dec.idle_pages()
    assert free + cached == total


def test_another_model_is_refused_at_the_handshake_naming_both_sides(model_factory, tcp_pair, reference):
    _, dec, _ = tcp_pair
    other = Driver(engine(model_factory("qwen3", False, 3), "cpu", disaggregation_mode="prefill",
                          disaggregation_bootstrap_port=0, disaggregation_transfer_timeout=TIMEOUT))
    try:
        remote = RemotePrefill("127.0.0.1", other.engine.disagg.agent.bootstrap_port)
        prompt = _prompt(40, 7)
        out = dec.wait(_submit(dec, remote, prompt))
        assert out.token_ids == plain_tokens(reference, prompt)        # answered, prefilled here
        refusal = dec.engine.disagg.status()["refusals"][-1]
        assert "layer count 3 vs 2" in refusal and "decode " in refusal and "prefill 127.0.0.1:" in refusal
        assert other.engine.disagg.status()["refusals"] and other.engine.disagg.status()["bytes"] == 0
        assert other.engine.disagg.status()["transfers_started"] == 0          # no byte moved
        free, cached, total = dec.idle_pages()
        assert free + cached == total
    finally:
        other.stop()
