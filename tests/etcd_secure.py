"""A real etcd over TLS with client-certificate checks and authentication, for the state tests:
certificates made here with ``cryptography`` (a CA, the server's, the router's client certificate, and
one from a CA the server does not trust), a root user, and a ``polychip`` user whose role may read
and write only the ``/polychip/`` prefix."""
from __future__ import annotations

import base64
import datetime
import ipaddress
import os
import ssl

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.etcd_cluster import EtcdCluster

USER, PASSWORD, ROOT_PASSWORD = "polychip", "s3cret-polychip", "s3cret-root"
TOKEN_TTL = 2          # seconds an unused token lives: the tests see the routers ask for a new one


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _no_cn(unit: str) -> x509.Name:
    """etcd answers 400 to a gateway request whose client certificate names a CommonName (it cannot
    map it to a user there): the routers' certificates name an organisation and a unit only."""
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "polychip"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit)])


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject) if ca or server else _no_cn(subject))
         .issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        # etcd's gateway dials the server with the server's own certificate: it must be a client's too
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(directory: str, name: str, cert, key) -> tuple[str, str]:
    cert_path, key_path = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}-key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return cert_path, key_path


class Certificates:
    """ca.pem; server.pem/-key.pem; client.pem/-key.pem (signed by the CA); rogue.pem/-key.pem (another CA)."""

    def __init__(self, directory: str):
        self.dir = directory
        ca_key, rogue_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca = _cert("polychip test CA", ca_key, _name("polychip test CA"), ca_key, ca=True)
        self.ca, _ = _write(directory, "ca", ca, ca_key)
        for name, server in (("server", True), ("client", False)):
            key = ec.generate_private_key(ec.SECP256R1())
            setattr(self, name, _write(directory, name, _cert(f"etcd-{name}", key, ca.subject, ca_key,
                                                              server=server), key))
        key = ec.generate_private_key(ec.SECP256R1())
        self.rogue = _write(directory, "rogue", _cert("rogue", key, _name("rogue CA"), rogue_ca_key), key)
        self.password_file = os.path.join(directory, "password")
        with open(self.password_file, "w") as f:
            f.write(PASSWORD + "\n")
        os.chmod(self.password_file, 0o600)


class SecureEtcd(EtcdCluster):
    """One member at https://127.0.0.1:PORT, --client-cert-auth, auth on (root and polychip users)."""

    def __init__(self):
        self.certs = None
        super().__init__(1, scheme="https", extra_args=self._tls_args)
        self._enable_auth()

    def _tls_args(self, directory: str) -> list[str]:
        self.certs = Certificates(directory)
        return ["--client-cert-auth", "--trusted-ca-file", self.certs.ca, "--cert-file", self.certs.server[0],
                "--key-file", self.certs.server[1], "--auth-token-ttl", str(TOKEN_TTL)]

    def http(self) -> httpx.Client:
        ctx = ssl.create_default_context(cafile=self.certs.ca)
        ctx.load_cert_chain(*self.certs.client)
        return httpx.Client(base_url=f"https://{self.endpoints[0]}", verify=ctx, timeout=10)

    def _enable_auth(self) -> None:
        self._admin([("/v3/auth/user/add", {"name": "root", "password": ROOT_PASSWORD}),
                     ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                     ("/v3/auth/role/add", {"name": "polychip"}),
                     ("/v3/auth/role/grant", {"name": "polychip", "perm": self._prefix("READWRITE")}),
                     ("/v3/auth/user/add", {"name": USER, "password": PASSWORD}),
                     ("/v3/auth/user/grant", {"user": USER, "role": "polychip"}),
                     ("/v3/auth/enable", {})])

    @staticmethod
    def _prefix(kind: str) -> dict:
        b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
        return {"key": b64("/polychip/"), "range_end": b64("/polychip0"), "permType": kind}

    def _admin(self, calls, as_root: bool = False) -> None:
        with self.http() as c:
            if as_root:
                root = {"name": "root", "password": ROOT_PASSWORD}
                c.headers["Authorization"] = c.post("/v3/auth/authenticate", json=root).json()["token"]
            for path, body in calls:
                r = c.post(path, json=body)
                assert r.status_code == 200, (path, r.status_code, r.text)

    def allow(self, kind: str) -> None:
        """The polychip role may now READ or READWRITE the /polychip/ prefix (etcd answers 403 to the rest)."""
        perm = self._prefix(kind)
        self._admin([("/v3/auth/role/revoke", {"role": "polychip", "key": perm["key"], "range_end": perm["range_end"]}),
                     ("/v3/auth/role/grant", {"name": "polychip", "perm": perm})], as_root=True)

    @property
    def spec(self) -> str:
        return "etcds://" + ",".join(self.endpoints)

    def access(self, **changes) -> dict:
        """The router settings that reach this etcd (``etcd:`` section), with ``changes``."""
        return {"ca": self.certs.ca, "cert": self.certs.client[0], "key": self.certs.client[1], "user": USER,
                "password_file": self.certs.password_file, **changes}
