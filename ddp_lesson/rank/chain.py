"""Several lesson scripts in one launch (plumbing; each script stays a whole torchrun script).

    torchrun ... beyond_amp.py --steps 3 --then beyond_compress --steps 24 --then beyond_dcp --save d

runs beyond_amp's run(), then beyond_compress's, then beyond_dcp's, in the same ranks and
process group: one `import torch` and one rendezvous per process instead of one per script.
A chained script is a module next to the first one with parse_args(argv) and run(args, device);
one without a --then option can only come last.

The first script's parse_args already imports every chained module and parses its arguments
(the --then option does it), so a misspelt name, a bad argument or a broken module stops the
run before the first section starts, not after the sections before it have run.
Chained modules are imported from the first script's folder when the ranks start: the run
directory's script.py is a copy of the first script only, not of the chained ones.
"""
import argparse
import importlib
import re
import sys
from pathlib import Path


class _Then(argparse.Action):
    """--then NAME ARGS...: import NAME, parse ARGS with its parse_args (which handles its own
    --then the same way) and keep [(module, args), ...] for every later link, in order."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not values:
            parser.error("--then needs a script name (and its arguments)")
        name, argv = values[0], values[1:]
        try:
            module = importlib.import_module(name)
        except ImportError as e:        # its error names the link (failed_in reads "NAME.py: error:")
            argparse.ArgumentParser(prog=f"{name}.py").error(f"--then {name}: {e}")
        prog = sys.argv[0]
        sys.argv[0] = f"{name}.py"      # so its argparse errors name it, not the first script
        try:
            args = module.parse_args(argv)
        finally:
            sys.argv[0] = prog
        setattr(namespace, self.dest, [(module, args)] + getattr(args, "then", []))


def add_then(parser):
    """The --then option: everything after it is the next script's name and its arguments."""
    parser.add_argument("--then", nargs=argparse.REMAINDER, action=_Then, default=[], metavar="SCRIPT ARGS",
                        help="then run SCRIPT (a script next to this one) with ARGS in these same ranks")


def main(parse_args, run):
    """A section script's whole life in its rank: the set-up every DDP script in 03-05 shows
    line by line (@record included), then this section's run(), then each --then section's,
    then the end."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # as in 03: a failing rank's traceback reaches torchrun's error summary
    def life():
        args = parse_args()
        local_rank = int(os.environ["LOCAL_RANK"])
        use_cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if use_cuda else "gloo")
        if use_cuda:
            torch.cuda.set_device(local_rank)
        device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
        run(args, device)
        then(getattr(args, "then", []), device)   # --then: later sections' scripts, in these same ranks
        dist.destroy_process_group()

    life()


def then(links, device):
    """Run each chained script in turn: links = args.then, as parsed by add_then's option."""
    for module, args in links:
        module.run(args, device)


def names(config):
    """The scripts of a launch (its config.json), in order: the first one, then each --then's."""
    args = list(config.get("args", []))
    return [Path(config["script"]).stem] + [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--then"]


def failed_in(config, failure):
    """Which script of a launch a failure (failures.root_cause) came from: the innermost frame
    of its traceback (or the stderr it holds) in one of the chain's scripts; None if none is."""
    chained = names(config)
    text = (failure or {}).get("traceback") or ""
    found = None
    for m in re.finditer(r'File "([^"]+)"|^(\S+)\.py: error:', text, re.M):
        stem = Path(m.group(1)).stem if m.group(1) else m.group(2)
        if stem == "script":                 # the run directory's copy of the first script
            stem = chained[0]
        if stem in chained:
            found = stem
    return found
