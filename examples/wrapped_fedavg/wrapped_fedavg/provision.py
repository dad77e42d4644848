"""Provision the nodes of a secure run: a long-term Ed25519 identity per node and the trust store they share.

    python -m wrapped_fedavg.provision KEYS_DIR NUM_NODES

writes ``KEYS_DIR/node-<i>.pem`` (node i's private key: it belongs on device i only) and ``KEYS_DIR/trust.json``
(client id -> public key: who each device accepts as a buffer-mate). In a real deployment each device generates
its own key and an operator it trusts distributes the public keys; one directory for all nodes is a simulation's
shortcut.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore


def provision(keys_dir: Path, num_nodes: int) -> None:
    keys_dir.mkdir(parents=True, exist_ok=True)
    public = {}
    for i in range(num_nodes):
        ident = NodeIdentity.generate()
        ident.save(keys_dir / f"node-{i}.pem")
        public[i] = ident.public_bytes()
    TrustStore(public).save(keys_dir / "trust.json")


if __name__ == "__main__":
    provision(Path(sys.argv[1]), int(sys.argv[2]))
