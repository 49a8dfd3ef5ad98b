"""The HA run, short: three routers over a three-member etcd, two fake replicas, a client spreading
over the three URLs that resends a refused or cut request to the next one, at concurrency 16 for
20 s; the leader router is SIGKILLed, then the etcd leader, then a rollout is set on one survivor
(benchmarks/router_ha.py runs the same for 2 minutes and prints the table)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from router_ha import run_ha  # noqa: E402

pytestmark = pytest.mark.device_independent
TTL = 3.0


def test_three_routers_survive_a_router_and_an_etcd_member_dying(tmp_path):
    client, res = run_ha(duration=20, concurrency=16, ttl=TTL, log_dir=str(tmp_path))   # pytest keeps the logs
    assert client.sent > 100 and client.failed == 0 and client.answered == client.sent, res["errors"]
    assert client.refused > 0, "the killed router's URL must have refused connections"
    # the survivors agree on a new leader once the dead one's lease runs out (TTL, and etcd checks
    # expiry every 0.5 s; +1.5 s for this shared machine)
    assert res["survivors_agree_on_leader"] and res["time_to_new_leader_s"] is not None
    assert res["time_to_new_leader_s"] <= TTL + 1.5, res
    assert res["members"] == ["r1", "r2"] or res["members"] == sorted(
        {"r0", "r1", "r2"} - {res["killed_router"]}), res
    assert res["registry"] == res["members"], "the dead router's replica registry must vanish with its lease"
    # rollout set on one router: stored, applied on the other within 1 s, and nothing sent 1 s after goes to v1
    assert res["rollout_set_status"] == 200 and res["weights_kept"]
    assert res["weight_store_lag_s"] is not None and res["weight_store_lag_s"] <= 1.0, res
    assert res["old_version_answers_1s_after_set"] == 0, res
    assert all(n > 0 for n in res["answers_after_set_per_router"].values())
