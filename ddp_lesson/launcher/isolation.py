"""Keeping a run private to its user on a shared machine (a classroom server).

A single-node run starts in a network of its own (rank/netns.py: an unprivileged user and
network namespace with only a loopback): torchrun's rendezvous store and gloo's sockets exist
only there, so no other local user can connect to them, list the store's keys or write to it,
and no port can clash with another run's. The warm process lives in such a network too, so its
runs do. What must cross from the kernel goes through Unix sockets in 0700 folders (the warm
process's socket, a live world's door): the file permissions keep other users out.

    isolation.status()           # Status(isolated=True/False, why=...)
    isolation.wrap(cmd)          # cmd, started in a private network where runs are isolated
    isolation.private_dir(p)     # a new folder only this user can enter, whatever the umask

Where the OS refuses namespaces (some containers' seccomp filters, distributions that restrict
them) runs use the machine's network; `doctor` and the run's first line say so. Runs over
several nodes always use the real network: they must reach each other. Setting
DDP_LESSON_SHARED_NETWORK=1 before the kernel starts turns isolation off (a GPU driver or NCCL
that misbehaves in a user namespace: tools/gpu_check.sh checks that).
"""
import functools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NETNS = str(Path(__file__).resolve().parents[1] / "rank" / "netns.py")
SHARED_ENV = "DDP_LESSON_SHARED_NETWORK"
# inside a private network only `lo` exists: gloo and NCCL are told so, rather than trying the
# address the host name resolves to and warning
RUN_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


@dataclass(frozen=True)
class Status:
    isolated: bool
    why: str = ""   # why not, where not

    def line(self):
        """One sentence for a run's first line and for doctor."""
        if self.isolated:
            return ("runs are private: each single-node run has a network of its own "
                    "that no other user of this machine can reach")
        return (f"runs are NOT isolated ({self.why}): other users of this machine could connect to "
                f"a run's rendezvous store and run code as you; on a shared machine give each learner "
                f"a container of their own (docs/instructors.md)")


@functools.lru_cache(maxsize=1)
def status():
    """Can this launcher put runs in a private network? Asked once per process (a few ms)."""
    if os.environ.get(SHARED_ENV) == "1":
        return Status(False, f"{SHARED_ENV}=1 is set")
    if not sys.platform.startswith("linux"):
        return Status(False, "private networks need Linux")
    try:
        p = subprocess.run(_python() + ["--probe"], capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Status(False, f"the probe failed: {e}")
    if p.returncode != 0:
        why = (p.stdout.strip() or p.stderr.strip().splitlines()[-1:] or ["?"])
        why = why if isinstance(why, str) else why[0]
        return Status(False, f"this OS refuses an unprivileged network namespace: {why}")
    return Status(True)


def _python():
    # -S -E -s: the wrapper imports nothing but the standard library, whatever the environment
    return [sys.executable, "-S", "-E", "-s", NETNS]


def wrap(cmd, join=None):
    """`cmd`, to be started in a private network where runs are isolated (netns.py execs it:
    same PID, same environment); `cmd` unchanged where they are not. join=PID: in the network
    process PID made (netns.py --join), not a new one."""
    if not status().isolated:
        return list(cmd)
    return _python() + (["--join", str(join)] if join is not None else []) + list(cmd)


@dataclass(frozen=True)
class ForRun:
    """What one launch does about its network: isolated or not, and why."""
    isolated: bool
    why: str

    def wrap(self, cmd):
        return _python() + list(cmd) if self.isolated else list(cmd)

    @property
    def env(self):
        """What the run's processes add to their environment (a variable the launch sets wins)."""
        return dict(RUN_ENV) if self.isolated else {}

    def config(self):
        return {"private_network": self.isolated, "why": self.why or None}


def for_run(single_node, env=None):
    """How a launch with `env` (its own variables) is kept private: single-node runs in a
    network of their own where the OS allows it; runs over several nodes on the real network."""
    if not single_node:
        return ForRun(False, "a run over several nodes uses the real network to reach the others")
    s = status()
    return ForRun(s.isolated, s.why)


def private_dir(prefix):
    """A new folder in the temporary directory that only this user can enter (mkdtemp: 0700)."""
    return tempfile.mkdtemp(prefix=prefix)


def make_private(path, mode=0o700):
    """chmod `path` to `mode` (0700 folders, 0600 files), whatever the umask made it."""
    os.chmod(path, mode)
    return path
