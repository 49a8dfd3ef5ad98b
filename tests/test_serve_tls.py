"""``serve --ssl-certfile --ssl-keyfile [--ssl-ca-certs]``: https with a certificate the client
checks against its CA bundle; with a CA for clients, a client without a certificate is refused.
``polychip router`` reaches such a replica with ``--replica-ca-bundle`` and its client certificate."""
from __future__ import annotations

import ssl
import time

import httpx
import pytest
from router_helpers import RouterProcess
from tls_helpers import make_pki

from polychip.http.launcher import ServerProcess

pytestmark = pytest.mark.device_independent


def _wait(srv: ServerProcess, client: httpx.Client, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log
        if "polychip ready" in srv.log:
            return
        time.sleep(0.2)
    raise TimeoutError(srv.log)


def test_mutual_tls_server(model_factory, tmp_path):
    pki = make_pki(str(tmp_path / "pki"))
    srv = ServerProcess(["--model-path", model_factory("llama", False), "--device", "cpu", "--served-model-name",
                         "m", "--max-total-tokens", "512", "--skip-server-warmup",
                         "--ssl-certfile", pki["server"][0], "--ssl-keyfile", pki["server"][1],
                         "--ssl-ca-certs", pki["ca"][0]])
    url = srv.url.replace("http://", "https://")
    try:
        mutual = ssl.create_default_context(cafile=pki["ca"][0])
        mutual.load_cert_chain(*pki["client"])
        with httpx.Client(verify=mutual, timeout=60) as client:
            _wait(srv, client)
            assert f"polychip ready: {url}" in srv.log
            r = client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"][0]), timeout=10) as anonymous:
            with pytest.raises(httpx.HTTPError):             # no client certificate: the handshake fails
                anonymous.get(url + "/health")
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health", timeout=10)              # the server's certificate is not in the default CAs
        router = RouterProcess(["--replica", url, "--replica-ca-bundle", pki["ca"][0], "--replica-client-cert",
                                pki["client"][0], "--replica-client-key", pki["client"][1]])
        try:
            router.wait_ready(1, timeout=60)
            r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3},
                           timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        finally:
            assert router.stop() == 0, router.log
    finally:
        assert srv.stop() == 0, srv.log
