"""The secure default of a real deployment: TLS with our own CA and SuperNode authentication.

One SuperLink and 2 registered SuperNodes on loopback train 2 rounds of BSDP-FedPDM through TLS, while a third
SuperNode, whose key was never registered, tries to join with the right CA and is refused by the SuperLink.
The SuperLink's port speaks TLS only and serves the certificate we generated.
"""

from __future__ import annotations

import json
import socket
import ssl
import stat
import subprocess
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from simulations.deploy import free_ports, local_deployment, still_running
from simulations.flower_driver import ROOT, FlowerRunError, run_flower
from simulations.pki import generate_pki, new_node_key

pytestmark = pytest.mark.deployment

OVERRIDES = {"algorithm": "bsdp-fedpdm", "dataset": "synthetic", "partitioner": "iid", "num-clients": 2,
             "clients-per-round": 2, "num-server-rounds": 2, "node-wait-s": 60}


def plain_http_reply(port: int) -> bytes:
    """What a plain-text HTTP request to 127.0.0.1:`port` gets back (b"" when the server hangs up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        try:
            return s.recv(64)
        except (ConnectionResetError, TimeoutError):
            return b""


def served_certificate(port: int, cafile: Path, server_hostname: str) -> bytes:
    """The certificate (DER) the server at 127.0.0.1:`port` presents to a client that trusts only `cafile`."""
    ctx = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def node_list(connection: str, env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(["flwr", "supernode", "list", connection, "--format", "json"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    return dict(json.loads(proc.stdout[proc.stdout.index("{"):]))


def test_registered_nodes_train_over_tls_and_an_unregistered_node_is_refused(tmp_path: Path) -> None:
    t0 = time.monotonic()
    home = tmp_path / "flwr-home"
    with local_deployment(2, flwr_home=home, startup_timeout=90) as dep:  # secure is the default
        startup_s = time.monotonic() - t0
        assert dep.env["FLWR_HOME"] == str(home.resolve()) and dep.env["FLWR_TELEMETRY_ENABLED"] == "0"
        assert f"[superlink.{dep.connection}]" in (home / "config.toml").read_text()
        pki = dep.pki
        assert pki is not None and len(dep.node_ids) == 2 and len(set(dep.node_ids)) == 2
        port = int(dep.address.rsplit(":", 1)[1])
        section = (home / "config.toml").read_text().split(f"[superlink.{dep.connection}]", 1)[1].split("[", 1)[0]
        assert f'root-certificates = "{pki.ca_cert}"' in section and "insecure" not in section
        for key in [pki.server_key, *(n.private_key for n in pki.nodes)]:
            assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
        assert pki.ca_key is None and not (pki.directory / "ca.key").exists()

        # An intruder: the right CA (it can reach the SuperLink), a valid key of its own that was never registered.
        intruder_key = new_node_key(tmp_path / "intruder")
        intruder_log = tmp_path / "intruder.log"
        with intruder_log.open("wb") as log:
            intruder = subprocess.Popen(
                ["flower-supernode", "--root-certificates", str(pki.ca_cert), "--superlink", dep.address,
                 "--auth-supernode-private-key", str(intruder_key.private_key), "--port", str(free_ports(1)[0]),
                 "--node-config", "partition-id=0 num-partitions=2"],
                env=dep.env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            # The port speaks TLS only and serves our certificate, valid for both loopback names.
            ours = x509.load_pem_x509_certificate(pki.server_cert.read_bytes()).public_bytes(Encoding.DER)
            assert served_certificate(port, pki.ca_cert, "127.0.0.1") == ours
            assert served_certificate(port, pki.ca_cert, "localhost") == ours
            other_ca = generate_pki(tmp_path / "other-ca", 0).ca_cert
            with pytest.raises(ssl.SSLCertVerificationError):
                served_certificate(port, other_ca, "127.0.0.1")
            assert not plain_http_reply(port).startswith(b"HTTP/")  # the insecure SuperLink answers "HTTP/1.1 ..."
            # the flwr CLI with an insecure connection to the same SuperLink gets nowhere
            cfg = home / "config.toml"
            cfg.write_text(cfg.read_text() + f'\n[superlink.plain]\naddress = "{dep.address}"\ninsecure = true\n')
            plain = node_list("plain", dep.env)
            assert plain["success"] is False and "unavailable" in str(plain["error-message"])

            try:
                res = run_flower(OVERRIDES, tmp_path / "out", connection=dep.connection, env=dep.env, stream=False,
                                 timeout=240)
            except FlowerRunError as err:
                pytest.fail(f"{err}\n{err.run.log if err.run else ''}\n{dep.logs_tail()}")
            intruder_rc = intruder.wait(timeout=60)  # refused long before the run ends; exits by itself
        finally:
            if intruder.poll() is None:
                intruder.kill()
                intruder.wait()
        listed = node_list(dep.connection, dep.env)
        tree = dep.process_tree()
    wall_s = time.monotonic() - t0
    # every process of the deployment (SuperLink, SuperNodes, the superexec / app processes they spawned) is gone,
    # and the CLI connection is removed again
    assert len(tree) >= 3
    assert still_running(tree) == []
    assert f"[superlink.{dep.connection}]" not in (home / "config.toml").read_text()

    # the refusal, as Flower reports it: flwr_exit logs "Exit Code: 305" (SuperNode could not connect) with the
    # SuperLink's "[code: 2004] Failed to activate SuperNode." and ends the process with status 1
    text = intruder_log.read_text(errors="replace")
    assert intruder_rc == 1, text
    assert "Exit Code: 305" in text and "[code: 2004] Failed to activate SuperNode." in text, text
    assert "SuperNode ID:" not in text
    # the SuperLink knows exactly the two registered nodes, both online; the intruder never got an id
    nodes = listed["nodes"]
    assert isinstance(nodes, list)
    assert sorted(int(n["node-id"]) for n in nodes) == sorted(dep.node_ids)
    assert all(n["status"] == "online" for n in nodes)
    for i, node_id in enumerate(dep.node_ids):
        assert f"SuperNode ID: {node_id}" in (dep.log_dir / f"supernode-{i}.log").read_text(errors="replace")

    # the registered nodes trained: 2 rounds, both clients each round
    assert res.status == "finished:completed"
    doc = json.loads(res.results.read_text())
    assert doc["engine"] == "flower-deployment"
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    assert all(r["clients"] == 2 and r["rejected"] == 0 for r in doc["rounds"])
    assert res.results == (tmp_path / "out" / "results.json").resolve()
    up = sum(r["uplink_bytes"] for r in doc["rounds"])
    down = sum(r["downlink_bytes"] for r in doc["rounds"])
    assert all(r["uplink_bytes"] > 0 and r["downlink_bytes"] > 0 and isinstance(r["test_accuracy"], float)
               for r in doc["rounds"])
    # The SuperLink's own count of the run's Fleet traffic (framing and the query.whoami exchange included) covers
    # our payload-only count in each direction (it counts message bytes, not TLS records: the same with and without)
    traffic = res.details.get("network-traffic")
    assert isinstance(traffic, dict), f"flwr list reports no network-traffic: {sorted(res.details)}"
    assert traffic["inbound-bytes"] >= up  # SuperNodes -> SuperLink (replies)
    assert traffic["outbound-bytes"] >= down  # SuperLink -> SuperNodes (train messages)
    assert traffic["total-bytes"] >= up + down
    print(f"secure deployment test: {wall_s:.1f} s wall (start-up incl. PKI + 2 registrations {startup_s:.1f} s)")
