"""``serve --seccomp``: a server under the syscall allowlist serves, streams, reports metrics and
shuts down cleanly; a process under the same filter cannot fork, exec, ptrace or open a network
socket; where libseccomp is missing the flag is refused with the reason."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from polychip.commands import serve as serve_cmd
from polychip.http.launcher import ServerProcess

pytestmark = pytest.mark.device_independent     # the Makefile installs libseccomp2: these run everywhere

FORBIDDEN = r'''
import ctypes, json, os, socket, subprocess, threading
from polychip.trust import seccomp
out = {"allowed": seccomp.apply()}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except OSError as e:
        out[name] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
def ptrace():
    if libc.ptrace(16, os.getppid(), 0, 0) != 0:      # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), "ptrace")
def mount():
    if libc.mount(b"none", b"/mnt", b"tmpfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mount")
attempt("fork", os.fork)
attempt("exec", lambda: subprocess.run(["/bin/true"]))
attempt("ptrace", ptrace)
attempt("mount", mount)
attempt("inet_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
t = threading.Thread(target=lambda: out.__setitem__("thread", "ran"))
t.start(); t.join()
a, b = socket.socketpair(); a.send(b"x"); out["socketpair"] = b.recv(1).decode()
print(json.dumps(out))
'''


def test_forbidden_syscalls_are_denied():
    res = subprocess.run([sys.executable, "-c", FORBIDDEN], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert {k: out[k] for k in ("fork", "exec", "ptrace", "mount", "inet_socket")} == \
        {"fork": 1, "exec": 1, "ptrace": 1, "mount": 1, "inet_socket": 1}      # EPERM, each
    assert out["thread"] == "ran" and out["socketpair"] == "x" and out["allowed"] > 100


ARGUMENT_LIMITS = r'''
import array, ctypes, fcntl, json, os, pty, signal, subprocess, sys, termios
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
from polychip.trust import seccomp
seccomp.apply()
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except OSError as e:
        out[name] = e.errno
def prctl(option, arg):
    if libc.prctl(option, ctypes.c_ulong(arg % 2**64), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")
attempt("kill_parent", lambda: os.kill(os.getppid(), 0))
attempt("kill_init", lambda: os.kill(1, 0))
attempt("kill_self", lambda: os.kill(os.getpid(), 0))
attempt("kill_own_group", lambda: os.kill(0, 0))
attempt("kill_child", lambda: os.kill(child.pid, signal.SIGKILL))
attempt("prctl_set_dumpable", lambda: prctl(4, 1))           # PR_SET_DUMPABLE: would open it to ptrace
attempt("prctl_set_ptracer", lambda: prctl(0x59616D61, -1))  # PR_SET_PTRACER_ANY
attempt("prctl_set_name", lambda: prctl(15, ctypes.addressof(ctypes.create_string_buffer(b"worker"))))
master, tty = pty.openpty()
attempt("ioctl_tiocsti", lambda: fcntl.ioctl(tty, termios.TIOCSTI, b"x"))   # types into a terminal
attempt("ioctl_tcgets", lambda: termios.tcgetattr(tty))
r, w = os.pipe()
attempt("ioctl_fionread", lambda: fcntl.ioctl(r, termios.FIONREAD, array.array("i", [0])))
print(json.dumps(out))
'''


def test_kill_prctl_and_ioctl_are_allowed_only_with_their_arguments():
    res = subprocess.run([sys.executable, "-c", ARGUMENT_LIMITS], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"kill_parent": 1, "kill_init": 1, "kill_self": "allowed", "kill_own_group": "allowed",
                   "kill_child": "allowed", "prctl_set_dumpable": 1, "prctl_set_ptracer": 1,
                   "prctl_set_name": "allowed", "ioctl_tiocsti": 1, "ioctl_tcgets": "allowed",
                   "ioctl_fionread": "allowed"}


FRONT = r'''
import ctypes, json, os, subprocess
from polychip.trust import seccomp
seccomp.apply_front()
libc = ctypes.CDLL(None, use_errno=True)
out = {"child": subprocess.run(["grep", "-c", "Seccomp:.2", "/proc/self/status"], capture_output=True,
                               text=True).stdout.strip()}
out["ptrace"] = 0 if libc.ptrace(16, os.getppid(), 0, 0) == 0 else ctypes.get_errno()
out["unshare"] = 0 if libc.unshare(0x20000000) == 0 else ctypes.get_errno()      # CLONE_NEWUTS
print(json.dumps(out))
'''


def test_the_dp_front_filter_lets_it_launch_replicas_that_inherit_it_and_denies_the_rest():
    res = subprocess.run([sys.executable, "-c", FRONT], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"child": "1", "ptrace": 1, "unshare": 1}


def test_a_server_under_seccomp_serves_streams_reports_and_stops(model_factory):
    path = model_factory("llama", False)
    srv = ServerProcess(["--model-path", path, "--device", "cpu", "--served-model-name", "m", "--seccomp",
                         "--enable-metrics", "--max-total-tokens", "512"])
    with srv:
        with open(f"/proc/{srv.proc.pid}/status") as f:
            assert "Seccomp:\t2" in f.read()                     # filter mode, in the serving process
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
        assert "polychip_" in httpx.get(srv.url + "/metrics", timeout=10).text
    assert srv.proc.returncode == 0, srv.log
    assert "seccomp: syscall allowlist applied" in srv.log and "polychip stopped" in srv.log


def test_refused_with_the_reason_where_libseccomp_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)          # import fails as on a host without it
    assert serve_cmd.main(["--seccomp", "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert "--seccomp cannot be applied here: libseccomp is not usable" in err
