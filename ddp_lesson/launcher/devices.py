"""Which devices a run gets: GPUs from nvidia-smi (CUDA is never initialised in the
calling process, so a notebook kernel stays fork-safe), or CPU processes on gloo."""
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

from .. import BadInput
from . import validate

CPU_DEFAULT_NPROC = 2


@dataclass
class GPU:
    index: int          # physical index, in PCI bus order (what nvidia-smi shows)
    name: str
    memory_total_mb: int
    memory_used_mb: int
    uuid: str = ""
    processes: list = field(default_factory=list)  # [(pid, used_mb), ...]

    @property
    def busy(self):
        return bool(self.processes)

    def label(self):
        busy = f", in use by {len(self.processes)} process(es)" if self.busy else ""
        return (f"GPU {self.index}: {self.name}, {self.memory_total_mb / 1024:.0f} GiB "
                f"({self.memory_used_mb} MiB used){busy}")


def _smi(args):
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, *args, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def _strtoul(s):
    """The number an entry starts with, as torch's _parse_visible_devices reads it ("2gpu" and
    "+2" are 2, "-0" is 0); -1 when it starts with no digit and no sign, or with a negative
    number. A sign with no digit after it ("+", "-", "+x") raises ValueError, as torch's own
    reading does: torch.cuda.device_count() fails on CUDA_VISIBLE_DEVICES=0,+ too."""
    digits = s[:1] if s[:1] in ("+", "-") else ""
    for c in s[len(digits):]:
        if not c.isdigit():
            break
        digits += c
    if not digits:
        return -1
    if not digits.lstrip("+-"):                       # torch's int(s[:idx]) fails here
        raise ValueError(f"the entry {s!r} is a sign with no digit, which torch cannot read")
    return int(digits)


def _gpu_uuid_ids(cuda_visible_devices, uuids):
    """A "GPU-" list in torch's two steps: first the strings (stop at the first entry without
    the prefix; a repeated string hides every GPU), then each string to the one GPU whose
    UUID starts with it (stop at one that matches none or several; a repeated GPU hides all)."""
    names = []
    for entry in cuda_visible_devices.split(","):
        if entry in names:
            return []
        if not entry.startswith("GPU-"):
            break
        names.append(entry)
    ids = []
    for name in names:
        match = [i for i, u in enumerate(uuids or ()) if u.startswith(name)]
        if len(match) != 1:
            break
        if match[0] in ids:
            return []
        ids.append(match[0])
    return ids


def visible_ids(cuda_visible_devices, n_physical, uuids=None):
    """The physical GPU ids a CUDA_VISIBLE_DEVICES string makes visible, in order, read the
    way torch 2.14's torch/cuda/__init__.py reads it (_parse_visible_devices, then
    _device_count_nvml): each entry is the number it starts with; a repeated id hides every
    GPU; the list stops at a negative or missing number, or at an id this machine lacks.
    An entry that is a bare sign ("0,+") raises ValueError, as torch's parser does.
    A "GPU-" list names GPUs by UUID prefixes, matched against `uuids` (the physical GPUs'
    UUIDs, by index); without them it shows no GPU. A "MIG-" list raises ValueError: it names
    slices of a GPU, not GPUs, and torch's NVML pre-count skips MIG lists and asks the CUDA
    runtime instead. The one parser of the course: list_gpus and the notebooks' picture use it."""
    if cuda_visible_devices.startswith("MIG-"):
        raise ValueError("MIG UUID lists are not modelled: torch's NVML pre-count skips them too")
    if cuda_visible_devices.startswith("GPU-"):
        return _gpu_uuid_ids(cuda_visible_devices, uuids)
    ids = []
    for entry in cuda_visible_devices.split(","):
        x = _strtoul(entry.strip())
        if x in ids:
            return []
        if x < 0:
            break
        ids.append(x)
    for i, x in enumerate(ids):
        if x >= n_physical:
            return ids[:i]
    return ids


def _visible(gpus, setting):
    """The GPUs a CUDA_VISIBLE_DEVICES value (physical indices or UUIDs, as an instructor
    may set per learner) leaves to this process, in the order listed, as torch counts them
    (visible_ids). A MIG list, or a list torch cannot read, gives none, with a warning:
    the course does not model MIG slices, so its plan falls back to CPU ranks."""
    by_index = {g.index: g for g in gpus}
    n_physical = max(by_index) + 1 if by_index else 0
    uuids = [by_index[i].uuid if i in by_index else "" for i in range(n_physical)]
    try:
        ids = visible_ids(setting, n_physical, uuids)
    except ValueError as e:
        what = ("names MIG slices, which the course does not model" if setting.startswith("MIG-")
                else f"is one torch cannot read ({e})")
        warnings.warn(f"CUDA_VISIBLE_DEVICES={setting!r} {what}: the course sees no GPU "
                      f"and plans CPU ranks.", stacklevel=3)
        return []
    return [by_index[i] for i in ids if i in by_index]


def list_gpus():
    """NVIDIA GPUs this process may use (empty list when there are none or no driver).
    Indices are physical (nvidia-smi's); a CUDA_VISIBLE_DEVICES already set in this
    process's environment narrows the list, so a learner given GPUs 2,3 sees only those."""
    rows = _smi(["--query-gpu=index,name,memory.total,memory.used,uuid"])
    if not rows:
        return []
    gpus = {}
    for idx, name, total, used, uuid in rows:
        gpus[uuid] = GPU(int(idx), name, int(float(total)), int(float(used)), uuid)
    for row in _smi(["--query-compute-apps=gpu_uuid,pid,used_memory"]) or []:
        if len(row) == 3 and row[0] in gpus:
            try:
                gpus[row[0]].processes.append((int(row[1]), int(float(row[2]))))
            except ValueError:
                pass
    found = sorted(gpus.values(), key=lambda g: g.index)
    setting = os.environ.get("CUDA_VISIBLE_DEVICES")
    return found if setting is None else _visible(found, setting)


def utilisation(indices=None):
    """[(index, busy %, memory used MiB, memory total MiB)] per GPU from nvidia-smi (physical
    indices, as in a run's config), [] without GPUs. Never touches CUDA in this process."""
    rows = _smi(["--query-gpu=index,utilization.gpu,memory.used,memory.total"]) or []
    out = []
    for row in rows:
        try:
            idx, util, used, total = int(row[0]), float(row[1]), float(row[2]), float(row[3])
        except (ValueError, IndexError):  # "[N/A]" on some boards
            continue
        if indices is None or idx in indices:
            out.append((idx, util, used, total))
    return out


def cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_cpu_nproc():
    """CPU ranks when none are asked: DDP_LESSON_NPROC if set (so tests and CI can play a
    machine with N devices), else CPU_DEFAULT_NPROC, at most one per core."""
    value = os.environ.get("DDP_LESSON_NPROC", "").strip()
    if not value:
        return max(1, min(CPU_DEFAULT_NPROC, cpu_count()))
    return validate.number("DDP_LESSON_NPROC", value, 1)


def default_gpus(found):
    """The GPUs a run gets when it names none and does not ask for CPU ranks: every GPU that
    nobody else is using, when there are two or more of those. Otherwise the answer is [] and
    the run gets default_cpu_nproc() CPU ranks, so that a learner sees several ranks and never
    lands on a GPU another process holds. A busy GPU, or a lone one, is used only when asked
    for by id: --gpus 0, or the picker's boxes with "use CPU processes" unticked.
    The one policy that the picker, %ranks start, the command line and plan() share."""
    free = [g.index for g in found if not g.busy]
    return free if len(free) >= 2 else []


def backend_for(use_gpus):
    """nccl for GPU ranks (not on Windows, where NCCL does not exist), gloo otherwise."""
    return "nccl" if use_gpus and sys.platform.startswith("linux") else "gloo"


@dataclass
class Plan:
    nproc: int
    gpus: list          # physical GPU indices, empty for CPU ranks
    backend: str
    env: dict           # what every rank's environment gets

    def describe(self):
        return describe(self.nproc, self.gpus, self.backend)

    def request(self):
        """The Request that gets exactly this plan again: these GPUs, or this many CPU ranks."""
        return Request(self.nproc, tuple(self.gpus) or None, cpu=not self.gpus)


def describe(nproc, gpus, backend):
    """The one wording of a device plan, for a Plan, a run's config and the picker.
    gpus: physical GPU ids, empty for CPU ranks."""
    if gpus:
        return f"{nproc} rank(s) on GPU(s) {','.join(map(str, gpus))} with {backend}"
    return f"{nproc} CPU process(es) with {backend}"


def _as_ids(gpus):
    if isinstance(gpus, str):
        parts = [p.strip() for p in gpus.split(",") if p.strip()]
        try:
            return [int(p) for p in parts]
        except ValueError:
            raise BadInput(f"--gpus takes GPU numbers separated by commas, like 0,1; got {gpus!r}.") from None
    try:
        return [validate.number("--gpus", g, 0) for g in gpus]
    except TypeError:
        raise BadInput(f"--gpus takes a list of GPU numbers, like [0, 1], or \"0,1\"; got {gpus!r}.") from None


@dataclass(frozen=True)
class Request:
    """The devices a launch asks for, checked for shape when built (BadInput, one sentence):
    `nproc` ranks (None: the default), the physical GPU ids `gpus` (a list or "0,1"; None:
    default_gpus(), that is every free GPU where there are two or more, else CPU ranks), or
    CPU ranks on gloo with cpu=True. Held as
    nproc: int or None, gpus: a tuple or None (None with cpu=True), cpu: bool. plan() checks it
    against this machine."""
    nproc: object = None
    gpus: object = None
    cpu: bool = False

    def __post_init__(self):
        nproc, gpus, cpu = validate.number("--nproc", self.nproc, 1, allow_none=True), None, bool(self.cpu)
        if self.gpus is not None and not cpu:
            gpus = tuple(_as_ids(self.gpus))
            if not gpus:
                raise BadInput("No GPU was selected; pick at least one, or use CPU processes.")
            if len(set(gpus)) != len(gpus):
                raise BadInput(f"GPU ids must not repeat, got {list(gpus)}.")
            if nproc is not None and nproc != len(gpus):
                raise BadInput(f"One process per GPU: {len(gpus)} GPU(s) selected but {nproc} processes asked.")
            nproc = len(gpus)
        object.__setattr__(self, "nproc", nproc)
        object.__setattr__(self, "gpus", gpus)
        object.__setattr__(self, "cpu", cpu)

    def plan(self, available=None):
        """The Plan for this request on this machine (`available`: its GPUs, default
        list_gpus()), or BadInput with one sentence."""
        found = list_gpus() if available is None else available
        if self.gpus is not None:
            have = {g.index for g in found}
            missing = [i for i in self.gpus if i not in have]
            if missing:
                what = f"GPUs {sorted(have)}" if have else "no NVIDIA GPU"
                raise BadInput(f"GPU {','.join(map(str, missing))} does not exist: this machine has {what}.")
            return _gpu_plan(list(self.gpus))
        ids = [] if self.cpu else default_gpus(found)
        if ids:
            if self.nproc is not None and self.nproc > len(ids):
                raise BadInput(f"This machine has {len(ids)} free GPU(s); ask for at most {len(ids)} "
                               f"processes, or use CPU processes (--cpu).")
            return _gpu_plan(ids[: self.nproc or len(ids)])
        n = validate.cpu_ranks(self.nproc or default_cpu_nproc(), cpu_count())
        threads = max(1, cpu_count() // n)
        return Plan(n, [], "gloo", {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)})


def plan(nproc=None, gpus=None, cpu=False, available=None):
    """Turn a request into a Plan, or raise BadInput with one sentence (see Request).

    gpus: None (default_gpus(): every free GPU where there are two or more, else CPU ranks), a list of physical ids or
    "0,1"; cpu=True forces CPU ranks on gloo even where GPUs exist."""
    return Request(nproc, gpus, cpu).plan(available)


def _gpu_plan(ids):
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}
    return Plan(len(ids), ids, backend_for(True), env)
