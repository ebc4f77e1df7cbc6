"""Run a command in a private network of its own: `python netns.py CMD ARGS...`.

It enters a new user namespace and a new network namespace (what `unshare --user
--map-current-user --net` does, as any user where the OS allows it), brings its loopback up
and then becomes CMD (exec: the same PID). Everything CMD and its children listen on, such as
torchrun's rendezvous store and gloo's sockets, exists only in that network: no other user's
process can connect to it, and no port can clash with another run's. Files, Unix sockets,
processes and signals are as before: only the network is private, and this user stays this
user (its own uid and gid are mapped, nothing else).

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


def main(argv):
    if argv == ["--probe"]:
        try:
            enter()
        except OSError as e:
            print(e.strerror or str(e))
            return 1
        return 0
    if not argv:
        print("usage: python netns.py CMD [ARGS...] | --probe", file=sys.stderr)
        return 2
    try:
        enter()
    except OSError as e:
        # the launcher probed first, so this is rare: refuse rather than run unprotected
        print(f"ddp_lesson: cannot make the run's private network ({e.strerror or e})", file=sys.stderr)
        return 1
    os.execv(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
