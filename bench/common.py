"""What the launch benches share: their command line (--nproc, --quick, --cpu, and the
--worker entry their own launch uses)."""
import argparse
import sys


def command_line(doc, worker, quick_help, argv=None):
    """The parsed flags, or None after running `worker` for `--worker ARGS` (the ranks)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
        return None
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--cpu", action="store_true", help="CPU ranks on gloo even where GPUs exist")
    return p.parse_args(argv)
