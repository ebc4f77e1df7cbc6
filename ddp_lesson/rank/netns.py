"""Run a command in a private network of its own: `python netns.py CMD ARGS...`.

It enters a new user namespace and a new network namespace (what `unshare --user
--map-current-user --net` does, as any user where the OS allows it), brings its loopback up
and then becomes CMD (exec: the same PID). Everything CMD and its children listen on, such as
torchrun's rendezvous store and gloo's sockets, exists only in that network: no other user's
process can connect to it, and no port can clash with another run's. Files, Unix sockets,
processes and signals are as before: only the network is private, and this user stays this
user (its own uid and gid are mapped, nothing else).

`python netns.py --join PID CMD ARGS...` enters the private network that process PID made
instead of a new one: a warm launch's warm processes (one per local rank) share one network,
so rank R, forked by warm process R, reaches the store the agent made in warm process 0's.

`python netns.py --probe` exits 0 if that works here, else prints why and exits 1.
Standard library only, and run as a file (no package import), so it costs a few ms.
"""
import ctypes
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def enter():
    """Move this (single-threaded) process into a new user and network namespace with loopback
    up. Raises OSError with the OS's reason where it refuses."""
    uid, gid = os.geteuid(), os.getegid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER|CLONE_NEWNET): {os.strerror(err)}")
    # map this user to itself: inside, files and processes keep their owners' ids
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    # a new network has only a loopback interface, and it is down: bring it up (the capability
    # to do so is ours in the namespace we made, and is dropped at exec)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _mapped(pid):
    with open(f"/proc/{pid}/gid_map") as f:
        return bool(f.read().strip())


def join(pid, wait_s=30.0):
    """Move this (single-threaded) process into the user and network namespace of process `pid`,
    once it has made them (it may still be starting). We own that user namespace, so we hold
    the capabilities setns(2) asks for there."""
    import time
    mine = os.readlink("/proc/self/ns/net")
    end = time.monotonic() + wait_s
    # and until it has mapped its ids (enter() writes gid_map last): a process that joins and
    # execs before then is not root there, even where it is root outside, so exec drops its
    # capabilities; a fork of it then cannot open /proc/<pid>/fd/N of a process that kept them
    # (EACCES: a warm rank opening its agent's output, now and then, as root)
    while os.readlink(f"/proc/{pid}/ns/net") == mine or not _mapped(pid):   # raises if pid is gone
        if time.monotonic() > end:
            raise OSError(0, f"process {pid} made no network of its own within {wait_s:.0f} s")
        time.sleep(0.005)
    libc = ctypes.CDLL(None, use_errno=True)
    for name, flag in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)):   # the user namespace first
        fd = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({name} of {pid}): {os.strerror(err)}")
        finally:
            os.close(fd)


def main(argv):
    if argv == ["--probe"]:
        try:
            enter()
        except OSError as e:
            print(e.strerror or str(e))
            return 1
        return 0
    if not argv:
        print("usage: python netns.py [--join PID] CMD [ARGS...] | --probe", file=sys.stderr)
        return 2
    try:
        if argv[0] == "--join":
            join(int(argv[1]))
            argv = argv[2:]
        else:
            enter()
    except OSError as e:
        # the launcher probed first, so this is rare: refuse rather than run unprotected
        print(f"ddp_lesson: cannot make the run's private network ({e.strerror or e})", file=sys.stderr)
        return 1
    os.execv(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
