"""``serve --seccomp``: a syscall allowlist applied to every thread of the serving process once the
model is loaded and the port is bound (libseccomp through ``pyseccomp``).

Allowed: what a loaded server needs to serve, stream, report metrics and shut down (file and
socket I/O on what it has, memory, threads, time, signals, polling, accepting connections).
Denied with EPERM: everything else, notably process creation (fork, exec, clone without
CLONE_THREAD; clone3 answers ENOSYS so threads fall back to clone), ptrace and other processes'
memory, mount and namespaces, module loading, bpf, reboot, changing credentials, new network
sockets (only AF_UNIX pairs) and outbound connect. docs/packages.md lists the profile.
"""
from __future__ import annotations

import errno
import logging
import os
import socket

from polychip.errors import ConfigError

log = logging.getLogger("polychip.trust")

CLONE_THREAD = 0x00010000

ALLOWED = (
    # files and descriptors the process has or opens
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
    "lseek", "close", "close_range", "open", "openat", "stat", "fstat", "lstat", "newfstatat", "statx",
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getdents64", "getcwd", "fcntl", "flock",
    "fsync", "fdatasync", "ftruncate", "rename", "renameat", "renameat2", "unlink", "unlinkat", "mkdir",
    "mkdirat", "fchmod", "dup", "dup2", "dup3", "pipe", "pipe2", "ioctl", "sendfile", "fadvise64", "statfs",
    "fstatfs", "umask", "utimensat", "memfd_create",
    # memory
    "mmap", "munmap", "mremap", "mprotect", "madvise", "brk", "membarrier", "mincore", "get_mempolicy",
    "set_mempolicy", "mbind",
    # threads, scheduling, time
    "futex", "set_robust_list", "get_robust_list", "set_tid_address", "rseq", "sched_yield",
    "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_getscheduler",
    "sched_get_priority_min", "sched_get_priority_max", "getcpu", "nanosleep", "clock_nanosleep",
    "clock_gettime", "clock_getres", "gettimeofday", "time", "exit", "exit_group", "prctl", "arch_prctl",
    # identity and limits (read only)
    "gettid", "getpid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid",
    "getresgid", "getrlimit", "prlimit64", "getrusage", "sysinfo", "uname", "times", "getrandom",
    # signals, and the tensor-parallel workers this process started (stop, reap)
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigtimedwait", "sigaltstack", "restart_syscall",
    "kill", "tgkill", "wait4", "waitid",
    # event loop
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll",
    "select", "pselect6", "eventfd2", "timerfd_create", "timerfd_settime", "signalfd4",
    # sockets the server already has (listening, accepted, the TP store's), and AF_UNIX pairs
    "listen", "accept", "accept4", "recvfrom", "recvmsg", "recvmmsg", "sendto", "sendmsg", "sendmmsg", "shutdown",
    "getsockname", "getpeername", "getsockopt", "setsockopt", "socketpair",
)
# with an argument condition: threads (not processes) and AF_UNIX sockets; added to ALLOWED's count
CONDITIONAL = ("clone (CLONE_THREAD set)", "socket (AF_UNIX)")


def unavailable() -> str:
    """Why --seccomp cannot be applied on this host ("" when it can)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            status = f.read()
    except OSError as e:
        return f"cannot read /proc/self/status to check the kernel: {e.strerror}"
    if "Seccomp:" not in status:
        return "this kernel has no seccomp (no 'Seccomp:' in /proc/self/status)"
    try:
        import pyseccomp  # noqa: F401  (ctypes: loads libseccomp.so.2)
    except (ImportError, OSError) as e:
        return f"libseccomp is not usable ({type(e).__name__}: {e}); install pyseccomp and Debian's libseccomp2"
    return ""


def check_available() -> None:
    why = unavailable()
    if why:
        raise ConfigError(f"--seccomp cannot be applied here: {why}")


def build_filter():
    """The filter (not loaded): ALLOWED, CONDITIONAL, clone3 -> ENOSYS, the rest -> EPERM."""
    import pyseccomp as sc
    f = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    count = 0
    for name in ALLOWED:
        try:
            f.add_rule(sc.ALLOW, name)
            count += 1
        except (ValueError, RuntimeError, OSError):
            log.debug("seccomp: %s does not exist on this architecture", name)
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, CLONE_THREAD))
    f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, socket.AF_UNIX))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")     # glibc then makes threads with clone, checked above
    f.set_attr(sc.Attr.CTL_TSYNC, 1)                 # every thread of the process, not only this one
    return f, count + len(CONDITIONAL)


def apply() -> int:
    """Load the filter into every thread of this process (irreversible). Returns the number of
    allowed syscalls."""
    check_available()
    f, count = build_filter()
    try:
        f.load()
    except OSError as e:
        raise ConfigError(f"--seccomp: the kernel refused the filter: {e}") from None
    log.info("seccomp: syscall allowlist applied to pid %d (%d syscalls allowed; process creation, ptrace, "
             "mount, module loading, new network sockets and outbound connect are denied)", os.getpid(), count)
    return count
