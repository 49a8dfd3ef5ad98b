"""``serve --seccomp``: a syscall allowlist applied to every thread of the serving process once the
model is loaded and the port is bound (libseccomp through ``pyseccomp``).

Allowed: what a loaded server needs to serve, stream, report metrics and shut down (file and
socket I/O on what it has, memory, threads, time, signals, polling, accepting connections).
Denied with EPERM: everything else, notably process creation (fork, exec, clone without
CLONE_THREAD; clone3 answers ENOSYS so threads fall back to clone), ptrace and other processes'
memory, mount and namespaces, module loading, bpf, reboot, changing credentials, new network
sockets (only AF_UNIX pairs) and outbound connect. Three calls are allowed only with some
arguments: ``kill`` to this process, its group or the children it has when the filter is applied
(its tensor-parallel workers), ``tgkill`` to its own threads; ``prctl`` with the read-only and
naming options (``PRCTL_OPTIONS``; not PR_SET_DUMPABLE, PR_SET_PTRACER, PR_SET_MM, ...); ``ioctl``
of the terminal type ('T') only the read-only ones (``TTY_IOCTLS``: no TIOCSTI, which types into
a terminal), device drivers' own requests (another type) unchanged. docs/packages.md lists it.

``apply_front`` is the profile of ``serve --dp-size``'s front, which launches and restarts its
replicas (so it may create processes and connect to them): everything is allowed but ``DENIED``
(ptrace, mount, namespaces, modules, bpf, credentials, clock, reboot, ...) and the writing
terminal ioctls; its replicas inherit it and add serve's own.
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
    "mkdirat", "fchmod", "dup", "dup2", "dup3", "pipe", "pipe2", "sendfile", "fadvise64", "statfs",
    "fstatfs", "umask", "utimensat", "memfd_create",
    # memory
    "mmap", "munmap", "mremap", "mprotect", "madvise", "brk", "membarrier", "mincore", "get_mempolicy",
    "set_mempolicy", "mbind",
    # threads, scheduling, time
    "futex", "set_robust_list", "get_robust_list", "set_tid_address", "rseq", "sched_yield",
    "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_getscheduler",
    "sched_get_priority_min", "sched_get_priority_max", "getcpu", "nanosleep", "clock_nanosleep",
    "clock_gettime", "clock_getres", "gettimeofday", "time", "exit", "exit_group", "arch_prctl",
    # identity and limits (read only)
    "gettid", "getpid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid",
    "getresgid", "getrlimit", "prlimit64", "getrusage", "sysinfo", "uname", "times", "getrandom",
    # signals, and the tensor-parallel workers this process started (reap; kill: conditional)
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigtimedwait", "sigaltstack", "restart_syscall",
    "wait4", "waitid",
    # event loop
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll",
    "select", "pselect6", "eventfd2", "timerfd_create", "timerfd_settime", "signalfd4",
    # sockets the server already has (listening, accepted, the TP store's), and AF_UNIX pairs
    "listen", "accept", "accept4", "recvfrom", "recvmsg", "recvmmsg", "sendto", "sendmsg", "sendmmsg", "shutdown",
    "getsockname", "getpeername", "getsockopt", "setsockopt", "socketpair",
)
# with an argument condition (build_filter); added to ALLOWED's count
CONDITIONAL = ("clone (CLONE_THREAD set)", "socket (AF_UNIX)", "kill (own pid, group, children)",
               "tgkill (own threads)", "prctl (PRCTL_OPTIONS)", "ioctl (TTY_IOCTLS, or not a terminal request)")
# prctl options a serving process uses or may (names, read-only queries); PR_SET_VMA names anonymous memory
PRCTL_OPTIONS = {"PR_GET_DUMPABLE": 3, "PR_SET_NAME": 15, "PR_GET_NAME": 16, "PR_GET_SECCOMP": 21,
                 "PR_GET_TIMERSLACK": 30, "PR_SET_NO_NEW_PRIVS": 38, "PR_GET_NO_NEW_PRIVS": 39,
                 "PR_SET_VMA": 0x53564D41}
# the terminal ('T' type) requests that only read: isatty, window size, process group, bytes
# waiting, non-blocking and close-on-exec switches
TTY_IOCTLS = {"TCGETS": 0x5401, "TIOCGPGRP": 0x540F, "TIOCGWINSZ": 0x5413, "FIONREAD": 0x541B,
              "FIONBIO": 0x5421, "FIONCLEX": 0x5450, "FIOCLEX": 0x5451}
TTY_TYPE_FIRST, TTY_TYPE_LAST = 0x5400, 0x54FF
LOW32 = 0xFFFFFFFF               # int arguments: compare the low 32 bits (a negative pid is sign-extended)
# the front's deny list: nothing a router or its replicas need
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
          "unshare", "setns", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
          "bpf", "perf_event_open", "reboot", "swapon", "swapoff", "setuid", "setgid", "setreuid", "setregid",
          "setresuid", "setresgid", "setfsuid", "setfsgid", "setgroups", "capset", "keyctl", "add_key",
          "request_key", "userfaultfd", "iopl", "ioperm", "acct", "settimeofday", "clock_settime",
          "clock_adjtime", "adjtimex", "open_by_handle_at", "name_to_handle_at", "quotactl", "syslog",
          "vhangup", "fanotify_init", "move_mount", "open_tree", "fsopen", "fsmount", "fspick",
          "mount_setattr")
TTY_WRITES = {"TIOCSTI": 0x5412, "TIOCLINUX": 0x541C, "TIOCSETD": 0x5423, "TIOCCONS": 0x541D}


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


def children() -> list[int]:
    """The processes this one started that still run (its tensor-parallel workers)."""
    me, out = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        out.append(int(entry))
            except (OSError, IndexError):
                continue                    # gone meanwhile
    return out


def build_filter(kill_targets: list[int] | None = None):
    """The filter (not loaded): ALLOWED, CONDITIONAL, clone3 -> ENOSYS, the rest -> EPERM.
    ``kill_targets``: the pids ``kill`` may reach besides this process and its group (default:
    its children now)."""
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
    me = os.getpid()
    targets = {me, 0, -os.getpgrp()} | set(children() if kill_targets is None else kill_targets)
    for pid in sorted(targets):
        f.add_rule(sc.ALLOW, "kill", sc.Arg(0, sc.MASKED_EQ, LOW32, pid & LOW32))
    f.add_rule(sc.ALLOW, "tgkill", sc.Arg(0, sc.MASKED_EQ, LOW32, me))
    for option in PRCTL_OPTIONS.values():
        f.add_rule(sc.ALLOW, "prctl", sc.Arg(0, sc.MASKED_EQ, LOW32, option))
    for request in TTY_IOCTLS.values():
        f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.MASKED_EQ, LOW32, request))
    f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.LT, TTY_TYPE_FIRST))      # a device driver's own requests
    f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.GT, TTY_TYPE_LAST))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")     # glibc then makes threads with clone, checked above
    f.set_attr(sc.Attr.CTL_TSYNC, 1)                 # every thread of the process, not only this one
    return f, count + len(CONDITIONAL)


def apply_front() -> int:
    """The front's filter (``serve --dp-size --seccomp``): everything but DENIED and the writing
    terminal ioctls; irreversible, and inherited by the replicas it launches. Returns how many
    calls it denies."""
    check_available()
    import pyseccomp as sc
    f, count = sc.SyscallFilter(defaction=sc.ALLOW), 0
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
            count += 1
        except (ValueError, RuntimeError, OSError):
            log.debug("seccomp: %s does not exist on this architecture", name)
    for request in TTY_WRITES.values():
        f.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, LOW32, request))
    f.set_attr(sc.Attr.CTL_TSYNC, 1)
    _load(f)
    log.info("seccomp: the front's filter applied to pid %d (%d syscalls denied: ptrace, mount, namespaces, "
             "module loading, bpf, credentials, clocks, reboot; and terminal input injection)", os.getpid(), count)
    return count


def _load(f) -> None:
    try:
        f.load()
    except OSError as e:
        raise ConfigError(f"--seccomp: the kernel refused the filter: {e}") from None


def apply() -> int:
    """Load the filter into every thread of this process (irreversible). Returns the number of
    allowed syscalls."""
    check_available()
    f, count = build_filter()
    _load(f)
    log.info("seccomp: syscall allowlist applied to pid %d (%d syscalls allowed; process creation, ptrace, "
             "mount, module loading, new network sockets and outbound connect are denied)", os.getpid(), count)
    return count
