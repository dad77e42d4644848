"""Key material for a secure Flower deployment, generated locally with `cryptography` (no openssl, no network).

`generate_pki(directory, num_nodes, hosts=...)` writes

    ca.crt                 self-signed CA certificate (PEM): SuperLink --ssl-ca-certfile, SuperNode --root-certificates,
                           and `root-certificates` of the CLI connection in $FLWR_HOME/config.toml
    ca.key                 the CA's private key (PEM, 0600; only with keep_ca_key=True): keep it on the operator's
                           machine, it is needed only to issue another SuperLink certificate
    superlink.crt/.key     the SuperLink's TLS certificate, signed by the CA, and its key (PEM, 0600):
                           --ssl-certfile / --ssl-keyfile
    supernode-<i>          node i's authentication key (EC P-384, OpenSSH private key, 0600):
                           flower-supernode --auth-supernode-private-key
    supernode-<i>.pub      its public key (OpenSSH): `flwr supernode register supernode-<i>.pub CONNECTION`

The SuperLink certificate's subjectAltName always holds IP:127.0.0.1 and DNS:localhost: the SuperLink's own
SuperExec connects to its Runtime API at 127.0.0.1:PORT when it listens on 0.0.0.0 (flwr 1.42,
`resolve_bind_address`), verifying this certificate with ca.crt. For several machines add the name or address the
SuperNodes dial (`hosts`). Flower 1.42 accepts SuperNode keys only on a NIST curve in OpenSSH format
(`load_ssh_private_key` in flower-supernode, `uses_nist_ec_curve` in `flwr supernode register`).

Command line (the operator's machine, for a deployment over several machines):

    python -m simulations.pki --out pki --nodes 3 --host 192.168.1.10 --host superlink.lab.example
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["DEFAULT_HOSTS", "DeploymentPKI", "NodeKey", "generate_pki", "main", "new_node_key"]

#: names every SuperLink certificate holds (the SuperLink's own SuperExec dials 127.0.0.1)
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class NodeKey:
    """One SuperNode's authentication key pair (OpenSSH files)."""

    private_key: Path  #: flower-supernode --auth-supernode-private-key (0600)
    public_key: Path  #: flwr supernode register <public_key> CONNECTION


@dataclass(frozen=True)
class DeploymentPKI:
    """Paths of the files `generate_pki` wrote, and the flags that use them."""

    directory: Path
    ca_cert: Path
    ca_key: Path | None
    server_cert: Path
    server_key: Path
    nodes: tuple[NodeKey, ...]
    hosts: tuple[str, ...]

    def superlink_args(self) -> list[str]:
        """flower-superlink flags: TLS with our certificate, and only registered SuperNodes admitted."""
        return ["--ssl-ca-certfile", str(self.ca_cert), "--ssl-certfile", str(self.server_cert),
                "--ssl-keyfile", str(self.server_key), "--enable-supernode-auth"]

    def supernode_args(self, index: int) -> list[str]:
        """flower-supernode flags of node `index`: trust our CA, authenticate with the node's key."""
        return ["--root-certificates", str(self.ca_cert), "--auth-supernode-private-key",
                str(self.nodes[index].private_key)]

    def connection_toml(self, name: str, address: str) -> str:
        """The [superlink.<name>] table of $FLWR_HOME/config.toml for the `flwr` CLI (TLS, no `insecure`)."""
        return f'[superlink.{name}]\naddress = "{address}"\nroot-certificates = "{self.ca_cert}"\n'


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` readable by the owner only (0600 from creation on, also when the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)  # O_CREAT's mode does not apply to a file that already existed
        fh.write(data)


def _san(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # de-duplicated, order kept
        if not host or any(c.isspace() for c in host) or "/" in host or host in ("0.0.0.0", "::"):
            raise ValueError(f"not a host name or address for the SuperLink certificate: {host!r} "
                             "(give the name or IP address the SuperNodes connect to, not a bind-all address)")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def new_node_key(private_key: Path, curve: ec.EllipticCurve | None = None) -> NodeKey:
    """Write a SuperNode authentication key pair: `private_key` (OpenSSH, 0600) and `private_key`.pub (OpenSSH)."""
    key = ec.generate_private_key(curve or ec.SECP384R1())
    _write_private(private_key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                  serialization.NoEncryption()))
    public = private_key.with_name(private_key.name + ".pub")
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b"\n")
    return NodeKey(private_key=private_key, public_key=public)


def generate_pki(directory: Path, num_nodes: int, *, hosts: Sequence[str] = (), days: int = 365,
                 keep_ca_key: bool = True, overwrite: bool = False) -> DeploymentPKI:
    """Write a CA, a SuperLink certificate for DEFAULT_HOSTS + `hosts` and `num_nodes` SuperNode keys to `directory`.

    `keep_ca_key=False` never writes the CA key (a throw-away local deployment needs no second certificate).
    Without `overwrite`, an existing ca.crt is an error: a new CA would invalidate every device already set up.
    """
    if num_nodes < 0:
        raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    all_hosts = tuple(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
    san = _san(all_hosts)
    directory = directory.resolve()
    if (directory / "ca.crt").exists() and not overwrite:
        raise FileExistsError(f"{directory / 'ca.crt'} exists; a new CA would invalidate the devices set up with "
                              "it (choose another directory, or overwrite deliberately)")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)

    now = dt.datetime.now(dt.UTC)
    not_before, not_after = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)  # 5 min of clock skew

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpdm-flower deployment CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (list(hosts) or ["localhost"])[0][:64])]))
        .issuer_name(ca_name).public_key(server_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    pem, pkcs8, none = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(pem))
    ca_key_path: Path | None = None
    if keep_ca_key:
        ca_key_path = directory / "ca.key"
        _write_private(ca_key_path, ca_key.private_bytes(pem, pkcs8, none))
    (directory / "superlink.crt").write_bytes(server_cert.public_bytes(pem))
    _write_private(directory / "superlink.key", server_key.private_bytes(pem, pkcs8, none))
    nodes = tuple(new_node_key(directory / f"supernode-{i}") for i in range(num_nodes))
    return DeploymentPKI(directory=directory, ca_cert=directory / "ca.crt", ca_key=ca_key_path,
                         server_cert=directory / "superlink.crt", server_key=directory / "superlink.key",
                         nodes=nodes, hosts=all_hosts)


def main(argv: list[str] | None = None) -> int:
    """`python -m simulations.pki --out DIR --nodes N [--host H ...]`: write the files, print where they go."""
    p = argparse.ArgumentParser(
        prog="python -m simulations.pki",
        description="Generate a CA, the SuperLink's TLS certificate and SuperNode authentication keys for a "
                    "Flower deployment (run it on the operator's machine).")
    p.add_argument("--out", required=True, help="directory for the files (created 0700)")
    p.add_argument("--nodes", type=int, required=True, help="SuperNode keys to generate")
    p.add_argument("--host", action="append", default=[],
                   help="name or IP address the SuperNodes dial for the SuperLink (repeatable); 127.0.0.1 and "
                        "localhost are always included")
    p.add_argument("--days", type=int, default=365, help="certificate validity in days (default 365)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing CA in --out")
    args = p.parse_args(argv)
    try:
        pki = generate_pki(Path(args.out), args.nodes, hosts=args.host, days=args.days, overwrite=args.overwrite)
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"CA certificate         {pki.ca_cert}   (SuperLink, every SuperNode, the flwr CLI)")
    print(f"CA key (keep private)  {pki.ca_key}")
    print(f"SuperLink cert/key     {pki.server_cert} {pki.server_key}   (SAN: {', '.join(pki.hosts)})")
    for i, node in enumerate(pki.nodes):
        print(f"SuperNode {i}            {node.private_key} -> device {i}; register {node.public_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
