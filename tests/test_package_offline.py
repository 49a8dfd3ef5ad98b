"""A package built here (where the network may be reachable) loads and generates in a process
whose network is gone: socket creation fails there, and HF_HUB_OFFLINE=1."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from polychip.trust import keys as signing
from polychip.package.pack import PackOptions, pack

pytestmark = pytest.mark.device_independent   # runs the default device (cpu), as the command it checks does

NO_NETWORK = textwrap.dedent('''
    import socket, sys

    class NoNetwork(socket.socket):
        def __init__(self, *args, **kwargs):
            raise OSError("network disabled in this test process")

    socket.socket = NoNetwork
    socket.create_connection = lambda *a, **k: NoNetwork()
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        print("sockets:", e, file=sys.stderr)
    else:
        sys.exit("sockets still work")
    from polychip.cli import main
    sys.exit(main(sys.argv[1:]))
''')


@pytest.fixture(scope="module")
def signed_package(model_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("offline")
    private, public = signing.keygen(str(d / "site"))
    out = str(d / "m.pcpkg")
    pack(PackOptions(out, model_factory("qwen3", True), "int8", sign_key=private))
    return out, public, d


def test_load_and_generate_without_network(signed_package):
    pkg, public, d = signed_package
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "POLYCHIP_CACHE": str(d / "cache")}
    cmd = [sys.executable, "-c", NO_NETWORK, "generate", "--model-path", pkg, "--trusted-key", public,
           "--require-signature", "--prompt", "hello", "--max-tokens", "5", "--log-level", "info"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "sockets: network disabled in this test process" in out.stderr
    assert "verified and extracted to" in out.stderr and "int8 weights" in out.stderr
    assert "[5 tokens, finish=length" in out.stderr
