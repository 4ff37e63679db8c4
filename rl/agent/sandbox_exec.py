"""The sandbox's second stage: set the limits in this process, then exec the command; run as a script, never imported.

    python -I -S sandbox_exec.py CPU_S MEMORY_BYTES FILE_BYTES NPROC NO_FORK -- COMMAND...

rl/agent/sandbox.py starts the child as `[namespace wrapper...] python -I -S sandbox_exec.py ... -- python -I main.py`
instead of setting the limits in a `preexec_fn`: a preexec_fn runs Python between fork and exec in a copy of the
run's multithreaded process (JAX's and the tool pool's threads), where a lock another thread held at the fork
deadlocks the child (CPython warns of it). Here the limits are set in a fresh single-threaded interpreter after
the namespace wrapper (bwrap, unshare) has made its own processes, so they bind exactly the model's code.
Only the standard library: `-I -S` puts neither the project nor site-packages on the path. A limit that cannot be
set exits 126 with one line on stderr (the tool error the model reads) and runs nothing.

NO_FORK = 1 installs a seccomp filter (x86_64 Linux) under which fork / vfork / clone of a new process fail with
EAGAIN (threads stay allowed): RLIMIT_NPROC does not bind root, so a root run needs it to stop fork bombs.
"""

import ctypes
import os
import platform
import resource
import struct
import sys

# seccomp-bpf (linux/filter.h, linux/seccomp.h): x86_64 fork (57), vfork (58), clone (56) without CLONE_THREAD ->
# EAGAIN; clone3 (435) -> ENOSYS (glibc then falls back to clone); everything else, and other architectures, allowed.
AUDIT_ARCH_X86_64, CLONE_THREAD, ALLOW, ERRNO = 0xC000003E, 0x10000, 0x7FFF0000, 0x00050000
NO_FORK_FILTER = [(0x20, 0, 0, 4), (0x15, 0, 8, AUDIT_ARCH_X86_64), (0x20, 0, 0, 0), (0x15, 7, 0, 57),
                  (0x15, 6, 0, 58), (0x15, 6, 0, 435), (0x15, 0, 3, 56), (0x20, 0, 0, 16),
                  (0x45, 1, 0, CLONE_THREAD), (0x06, 0, 0, ERRNO | 11), (0x06, 0, 0, ALLOW),
                  (0x06, 0, 0, ERRNO | 11), (0x06, 0, 0, ERRNO | 38)]


def forbid_new_processes() -> None:
    """Install the no-fork seccomp filter in this process; a no-op off x86_64 Linux."""
    if platform.machine() != "x86_64":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    prog = b"".join(struct.pack("HBBI", *ins) for ins in NO_FORK_FILTER)
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HxxxxxxQ", len(NO_FORK_FILTER), ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0):  # NO_NEW_PRIVS, SECCOMP
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


def main(argv: list[str]) -> None:
    cpu_s, memory_bytes, file_bytes, nproc, no_fork = (int(a) for a in argv[:5])
    if argv[5] != "--" or len(argv) < 7:
        raise SystemExit("sandbox_exec: usage: CPU_S MEMORY_BYTES FILE_BYTES NPROC NO_FORK -- COMMAND...")
    command = argv[6:]
    try:
        for what, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_bytes),
                            (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NPROC, nproc),
                            (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(what, (value, value + (what == resource.RLIMIT_CPU)))  # SIGXCPU, then SIGKILL
        if no_fork:
            forbid_new_processes()
    except (OSError, ValueError) as e:
        print(f"sandbox could not set its limits: {e}", file=sys.stderr)
        os._exit(126)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
