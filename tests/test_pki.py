"""simulations.pki: the files Flower's own loaders accept, a TLS handshake through Python's ssl (OpenSSL) with the
certificates we generate, private keys 0600. No Flower process runs here (tests/test_deployment_secure.py does)."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, load_ssh_private_key, load_ssh_public_key
from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

from simulations.deploy import build_parser
from simulations.pki import generate_pki, main, new_node_key


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_permissions_and_flower_key_format(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path / "pki", 3, hosts=["10.1.2.3", "superlink.lab.example"])
    assert _mode(pki.directory) == 0o700
    assert pki.ca_key is not None
    for private in [pki.ca_key, pki.server_key, *(n.private_key for n in pki.nodes)]:
        assert _mode(private) == 0o600, private
    # what flower-supernode (load_ssh_private_key, EC) and `flwr supernode register` (NIST curve) check
    publics = set()
    for node in pki.nodes:
        key = load_ssh_private_key(node.private_key.read_bytes(), None)
        pub = load_ssh_public_key(node.public_key.read_bytes())
        assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(pub, ec.EllipticCurvePublicKey)
        assert uses_nist_ec_curve(pub) and key.public_key() == pub
        assert node.public_key.read_text().startswith("ecdsa-sha2-nistp384 ")
        publics.add(node.public_key.read_bytes())
    assert len(publics) == 3  # one key per node

    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                       ipaddress.ip_address("10.1.2.3")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "superlink.lab.example"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert pki.superlink_args()[-1] == "--enable-supernode-auth"
    assert pki.supernode_args(1) == ["--root-certificates", str(pki.ca_cert), "--auth-supernode-private-key",
                                     str(pki.nodes[1].private_key)]
    toml = pki.connection_toml("lab", "10.1.2.3:8000")
    assert f'root-certificates = "{pki.ca_cert}"' in toml and "insecure" not in toml


def _handshake(pki_server: Path, ca_cert: Path, server_hostname: str) -> bytes:
    """A TLS 1.2+ handshake over a socket pair: server with superlink.crt/.key, client trusting `ca_cert` and
    checking `server_hostname` with X.509 strict checks (Python 3.13's default). Returns the served cert (DER)."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(pki_server / "superlink.crt", pki_server / "superlink.key")
    client_ctx = ssl.create_default_context(cafile=str(ca_cert))
    client_ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (OSError, ssl.SSLError) as err:
            errors.append(err)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=server_hostname) as c:
            der = c.getpeercert(binary_form=True)
            c.sendall(b"x")
    finally:
        t.join(10)
        a.close()
        b.close()
    assert der is not None
    return der


def test_tls_handshake_with_python_ssl(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path / "pki", 0, hosts=["10.1.2.3", "superlink.lab.example"])
    served = x509.load_pem_x509_certificate(pki.server_cert.read_bytes()).public_bytes(Encoding.DER)
    for host in ["127.0.0.1", "localhost", "10.1.2.3", "superlink.lab.example"]:
        assert _handshake(pki.directory, pki.ca_cert, host) == served
    with pytest.raises(ssl.SSLCertVerificationError, match=r"mismatch|doesn't match"):
        _handshake(pki.directory, pki.ca_cert, "10.9.9.9")  # not in the SAN
    other = generate_pki(tmp_path / "other", 0)
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        _handshake(pki.directory, other.ca_cert, "127.0.0.1")  # another CA does not vouch for our SuperLink


def test_bad_input_and_existing_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generate_pki(tmp_path / "pki", 1, keep_ca_key=False)
    assert not (tmp_path / "pki" / "ca.key").exists()
    with pytest.raises(FileExistsError, match=r"ca\.crt exists"):
        generate_pki(tmp_path / "pki", 1)
    generate_pki(tmp_path / "pki", 1, overwrite=True)  # deliberate
    with pytest.raises(ValueError, match="bind-all"):
        generate_pki(tmp_path / "x", 1, hosts=["0.0.0.0"])
    with pytest.raises(ValueError, match="num_nodes"):
        generate_pki(tmp_path / "y", -1)
    # an existing private key file keeps no wider mode than 0600 after being rewritten
    key = tmp_path / "k"
    key.write_text("old")
    key.chmod(0o644)
    new_node_key(key)
    assert _mode(key) == 0o600
    assert main(["--out", str(tmp_path / "cli"), "--nodes", "2", "--host", "192.168.0.7"]) == 0
    assert (tmp_path / "cli" / "supernode-1.pub").exists() and "192.168.0.7" in capsys.readouterr().out
    assert main(["--out", str(tmp_path / "cli"), "--nodes", "2"]) == 2
    assert "ca.crt exists" in capsys.readouterr().err


def test_deploy_cli_is_secure_unless_insecure_is_named() -> None:
    parse = build_parser().parse_args
    assert parse(["--nodes", "2"]).insecure is False
    assert parse(["--nodes", "2", "--secure"]).insecure is False
    assert parse(["--nodes", "2", "--insecure"]).insecure is True
    with pytest.raises(SystemExit):
        parse(["--secure", "--insecure"])
