"""A real Flower deployment on loopback: 1 SuperLink + 2 SuperNodes as separate processes, 2 rounds of BSDP-FedPDM.

Uses a fresh FLWR_HOME and free ports, so it never touches the simulation SuperLink (39091) or .flwr/.
Both runs are the explicit `insecure` opt-in (plain-text daemons, no node authentication), which keeps them as
fast as before; tests/test_deployment_secure.py runs the secure default (TLS + registered node keys).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_deployment_secure import plain_http_reply

from simulations.deploy import local_deployment, still_running
from simulations.flower_driver import FlowerRunError, run_flower

pytestmark = pytest.mark.deployment

OVERRIDES = {"algorithm": "bsdp-fedpdm", "dataset": "synthetic", "partitioner": "iid", "num-clients": 2,
             "clients-per-round": 2, "num-server-rounds": 2, "node-wait-s": 60}


def test_two_supernodes_run_bsdp_fedpdm_to_completion(tmp_path: Path) -> None:
    t0 = time.monotonic()
    home = tmp_path / "flwr-home"
    with local_deployment(2, flwr_home=home, secure=False, startup_timeout=60) as dep:  # insecure, by name
        assert dep.env["FLWR_HOME"] == str(home.resolve()) and dep.env["FLWR_TELEMETRY_ENABLED"] == "0"
        assert f"[superlink.{dep.connection}]" in (home / "config.toml").read_text()
        assert dep.pki is None and dep.node_ids == [] and not (home / "pki").exists()
        # plain text answers plain HTTP (the secure test asserts the TLS SuperLink does not)
        assert plain_http_reply(int(dep.address.rsplit(":", 1)[1])).startswith(b"HTTP/1.1 ")
        try:
            res = run_flower(OVERRIDES, tmp_path / "out", connection=dep.connection, env=dep.env, stream=False,
                             timeout=150)
        except FlowerRunError as err:
            pytest.fail(f"{err}\n{err.run.log if err.run else ''}\n{dep.logs_tail()}")
        tree = dep.process_tree()  # SuperLink, SuperNodes and the superexec/app processes they spawned
    startup_and_run_s = time.monotonic() - t0

    # every process of the deployment is gone and the connection is removed again
    assert len(tree) >= 3
    assert still_running(tree) == []
    assert f"[superlink.{dep.connection}]" not in (home / "config.toml").read_text()

    assert res.status == "finished:completed"
    doc = json.loads(res.results.read_text())
    assert res.results == (tmp_path / "out" / "results.json").resolve()
    assert doc["engine"] == "flower-deployment"
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["uplink_bytes"] > 0 and r["downlink_bytes"] > 0
        assert isinstance(r["test_accuracy"], float)
        assert r["clients"] == 2  # both nodes answered (node i holds partition i)
    up = sum(r["uplink_bytes"] for r in doc["rounds"])
    down = sum(r["downlink_bytes"] for r in doc["rounds"])

    # The SuperLink's own count of the run's Fleet traffic (SuperNode <-> SuperLink, framing and the
    # query.whoami exchange included) must cover our payload-only count in each direction.
    traffic = res.details.get("network-traffic")
    assert isinstance(traffic, dict), f"flwr list reports no network-traffic: {sorted(res.details)}"
    assert traffic["inbound-bytes"] >= up  # SuperNodes -> SuperLink (replies)
    assert traffic["outbound-bytes"] >= down  # SuperLink -> SuperNodes (train messages)
    assert traffic["total-bytes"] >= up + down
    print(f"deployment test: {startup_and_run_s:.1f} s; counted uplink {up} B, downlink {down} B; "
          f"SuperLink network-traffic {traffic}")


# Masked FedREP on a real deployment (4 SuperNodes, two exchanges a round between separate processes, real key
# agreement, masks that cancel only inside each buffer) is tests/test_faults.py::
# test_fedrep_masked_leaves_the_dead_node_out_of_the_buffers: round 1 with all four nodes, round 2 after one died.
