"""What a launch is, checked when it is built, and how a run's config.json records it.

    s = Spec("train.py", devices.Request(nproc=2, cpu=True), args=["--epochs", "1"], timeout=60)
    run = launch.run(s)               # launch.start("train.py", nproc=2, ...) builds the same Spec
    Spec.of_run(run.run_dir)          # the same launch again: its script.py, on the devices it got

A Spec is a value: frozen, compared by its fields, run as often as wanted (each launch gets
its own run directory, which is why the directory is not part of it). Every check of a
launch's input happens when one is built, here and in devices.Request, before anything
starts: bad input is one sentence (BadInput). Only what needs this machine waits for the
launch: devices.Request.plan() (which GPUs exist) and the run directory.

config.json holds fields(spec, plan) and what the launcher adds (token, versions, command,
...). Its `devices` is always a list of physical GPU ids, [] for CPU ranks; gpus(config) is
the one way to read it. Its `env` is what the launch added (Spec.env), `device_env` what the
devices gave every rank (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, ...); device_env(config)
reads it.
"""
from dataclasses import dataclass, field
from pathlib import Path

from .. import BadInput
from ..rank import rundir
from . import validate
from .devices import Plan, Request

RDZV_ID = "ddp-lesson"   # the rendezvous id of a run over several nodes unless one is given


@dataclass(frozen=True)
class Nodes:
    """Where a launch sits among nodes: alone (count 1: torchrun --standalone), or node `rank`
    of `count`, meeting at `endpoint` (HOST:PORT on node 0) under the rendezvous `id`."""
    count: int = 1
    rank: int = 0
    endpoint: object = None
    id: object = None

    def __post_init__(self):
        count = validate.number("--nnodes", self.count, 1)
        rank = validate.number("--node-rank", self.rank, 0)
        if rank >= count:
            raise BadInput(f"--node-rank must be below --nnodes ({count}), got {rank}.")
        if count > 1 and not self.endpoint:
            raise BadInput("A run over several nodes needs --rdzv-endpoint HOST:PORT (node 0's address).")
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "rank", rank)
        # alone, a node has no rendezvous to name: what was passed would be ignored anyway
        object.__setattr__(self, "endpoint", str(self.endpoint) if count > 1 else None)
        object.__setattr__(self, "id", str(self.id or RDZV_ID) if count > 1 else None)

    def torchrun_args(self):
        """torchrun's rendezvous flags for these nodes."""
        if self.count == 1:
            return ["--standalone"]
        return ["--nnodes", str(self.count), "--node-rank", str(self.rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.id]


def _pairs(what, mapping, value):
    """A mapping as sorted (name, value(v)) pairs: hashable, compared by content."""
    if not mapping:
        return ()
    try:
        return tuple(sorted((str(k), value(v)) for k, v in dict(mapping).items()))
    except (TypeError, ValueError):
        raise BadInput(f"{what}; got {mapping!r}.") from None


def _free_name(name):
    """A private file's name: a bare file name that the run directory's contract leaves free."""
    name = str(name)
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and name not in rundir.RESERVED


def _data(value):
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(value)
    return bytes(value)


@dataclass(frozen=True)
class Spec:
    """One launch: `script` under torchrun on `devices`, with the script's `args`, elastic
    `max_restarts`, a `timeout` in seconds (None: none), `env` added to every rank's
    environment, a `label` for plots and titles (default: the script's stem), its `nodes`,
    `private_files` written 0600 into the run directory before any process starts (never
    recorded in config.json), and `cold` (the agent and every rank as new interpreters, as a
    CLI torchrun starts them). Built from plain values; held normalised: a Path, tuples, a
    float timeout, env and private_files as sorted (name, value) pairs, the script's path absolute
    (a launch from another working folder runs the same file)."""
    script: Path
    devices: Request = Request()
    args: tuple = ()
    max_restarts: int = 0
    timeout: object = None
    env: tuple = ()
    label: object = None
    nodes: Nodes = Nodes()
    private_files: tuple = field(default=(), repr=False)
    cold: bool = False

    def __post_init__(self):
        script = Path(self.script).resolve()
        if not script.is_file():
            raise BadInput(f"The script {self.script} does not exist." if not script.exists()
                           else f"The script {self.script} is not a file.")
        if not isinstance(self.devices, Request):
            raise BadInput(f"A launch's devices must be a devices.Request, like Request(nproc=2); "
                           f"got {self.devices!r}.")
        if isinstance(self.args, (str, bytes)) or not hasattr(self.args, "__iter__"):
            raise BadInput(f"The script's args must be a list of words, like [\"--epochs\", \"1\"]; "
                           f"got {self.args!r}.")
        if not isinstance(self.nodes, Nodes):
            raise BadInput(f"A launch's nodes must be a spec.Nodes, like Nodes(2, 0, \"host:29400\"); "
                           f"got {self.nodes!r}.")
        try:
            files = dict(self.private_files or {})
        except (TypeError, ValueError):
            files = {}   # _pairs below says what is wrong
        bad = [name for name in files if not _free_name(name)]
        if bad:
            raise BadInput(f"A private file needs a bare file name that the run directory leaves free "
                           f"(not {', '.join(rundir.RESERVED)}); got {str(bad[0])!r}.")
        normal = {
            "script": script, "args": tuple(str(a) for a in self.args),
            "max_restarts": validate.number("--max-restarts", self.max_restarts, 0),
            "timeout": validate.number("--timeout", self.timeout, 0.001, kind=float, allow_none=True),
            "env": _pairs("The env must map names to values, like {\"OMP_NUM_THREADS\": 1}", self.env, str),
            "label": str(self.label) if self.label else script.stem,
            "private_files": _pairs("The private_files must map file names to bytes", self.private_files, _data),
            "cold": bool(self.cold)}
        for name, value in normal.items():
            object.__setattr__(self, name, value)   # frozen: only here, while it is built

    @classmethod
    def of_run(cls, run_dir):
        """The launch that made the run in `run_dir` again: the script.py it ran (the learner's
        file may have changed since), its arguments, options, env and nodes, pinned to the
        devices its ranks had; private files are never recorded, so none."""
        config = rundir.read_json(rundir.config(run_dir))
        if config is None:
            raise BadInput(f"{run_dir} is not a run directory (no readable {rundir.CONFIG}).")
        env = config.get("env") or {}
        plan = Plan(config["nproc"], gpus(config), config.get("backend"), device_env(config))
        return cls(rundir.script(run_dir), plan.request(), args=config.get("args", ()),
                   max_restarts=config.get("max_restarts", 0), timeout=config.get("timeout"), env=env,
                   label=config.get("label"), nodes=Nodes(config.get("nnodes", 1), config.get("node_rank", 0),
                                                         config.get("rdzv_endpoint"), config.get("rdzv_id")),
                   cold=config.get("cold", False))


def fields(spec, plan):
    """What config.json records of launching `spec` on `plan` (a devices.Plan)."""
    return {
        "script": str(spec.script), "args": list(spec.args), "label": spec.label,
        "nproc": plan.nproc, "devices": list(plan.gpus), "backend": plan.backend,
        "world_size": plan.nproc * spec.nodes.count, "nnodes": spec.nodes.count,
        "node_rank": spec.nodes.rank, "rdzv_endpoint": spec.nodes.endpoint, "rdzv_id": spec.nodes.id,
        "max_restarts": spec.max_restarts, "timeout": spec.timeout, "cold": spec.cold,
        "env": dict(spec.env), "device_env": dict(plan.env),
    }


def gpus(config):
    """The physical GPU ids a run's ranks had, from its config (a dict): [] for CPU ranks."""
    return [int(g) for g in (config or {}).get("devices") or []]


def device_env(config):
    """What the devices gave every rank's environment (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS,
    ...), from a run's config (a dict)."""
    return dict((config or {}).get("device_env") or {})
