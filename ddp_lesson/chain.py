"""Several lesson scripts in one launch (plumbing; each script stays a whole torchrun script).

    torchrun ... beyond_amp.py --steps 3 --then beyond_compress --steps 24 --then beyond_dcp --save d

runs beyond_amp's run(), then beyond_compress's, then beyond_dcp's, in the same ranks and
process group: one `import torch` and one rendezvous per process instead of one per script.
A chained script is a module next to the first one with parse_args(argv) and run(args, device);
one without a --then option can only come last.
"""
import argparse
import importlib


def add_then(parser):
    """The --then option: everything after it is the next script's name and its arguments."""
    parser.add_argument("--then", nargs=argparse.REMAINDER, default=[], metavar="SCRIPT ARGS",
                        help="then run SCRIPT (a script next to this one) with ARGS in these same ranks")


def then(argv, device):
    """Run each chained script in turn: argv = [name, its arguments, maybe --then ...]."""
    while argv:
        script = importlib.import_module(argv[0])
        args = script.parse_args(argv[1:])
        script.run(args, device)
        argv = getattr(args, "then", [])      # a script without --then ends the chain
