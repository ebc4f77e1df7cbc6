"""Command line: python -m ddp_lesson {run,demo,doctor,cleanup,slurm} ...

Exit status of run/demo: 0 all ranks succeeded; 1 the run failed or timed out;
2 bad input, found before anything starts; 130 interrupted, after every process is gone.
"""
import argparse
import signal
import sys

from . import BadInput
from .launcher import devices, failures, isolation, launch, monitor, validate
from .rank.bundled import script
from .launcher.spec import Nodes, Spec

EXIT = {"ok": 0, "failed": 1, "timeout": 1, "interrupted": 130}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence, no usage block
        raise BadInput(f"{message[0].upper()}{message[1:]} (see: {self.prog} --help).")


def _device_args(p):
    p.add_argument("--nproc", help="processes (ranks) on this node; default: one per GPU with two or more GPUs, else 2 CPU processes")
    p.add_argument("--gpus", help="physical GPU ids to use, e.g. 0,1 (one rank each)")
    p.add_argument("--cpu", action="store_true", help="CPU processes on gloo even where GPUs exist")
    p.add_argument("--run-dir", help="a new folder for this run (default: runs/<time>-<script>)")
    p.add_argument("--cold", action="store_true",
                   help="start the agent and every rank as new interpreters, as a CLI torchrun does "
                        "(default: forked from a warm process that has imported torch)")


def build_parser():
    top = Parser(prog="python -m ddp_lesson", description=__doc__.split("\n")[0])
    sub = top.add_subparsers(dest="command", parser_class=Parser, required=True)
    run = sub.add_parser("run", help="launch a script under torchrun and supervise it",
                         epilog="Exit status: 0 ok, 1 failed or timed out, 2 bad input, 130 interrupted. "
                                "Ctrl-C (SIGINT) or SIGTERM stops every process of the run. Started with "
                                "SIGINT ignored (a background job of a script, nohup), the run leaves it "
                                "ignored, as such jobs expect; SIGTERM still stops it.")
    run.add_argument("script")
    _device_args(run)
    run.add_argument("--max-restarts", default=0, help="elastic restarts after a failure (default 0)")
    run.add_argument("--timeout", help="stop the run after this many seconds (status: timeout)")
    run.add_argument("--nnodes", default=1, help="number of nodes (default 1)")
    run.add_argument("--node-rank", default=0, help="this node's rank among the nodes")
    run.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, for several nodes")
    run.add_argument("--quiet", action="store_true", help="do not echo the ranks' output")
    demo = sub.add_parser("demo", help="train the reference DDP script (notebook 03's ddp_basic.py) on the built-in data")
    _device_args(demo)
    demo.add_argument("--epochs", default="3", help="epochs (default 3)")
    sub.add_parser("doctor", help="check this machine before a workshop")
    clean = sub.add_parser("cleanup", help="stop leftover processes of ddp_lesson runs")
    clean.add_argument("--dry-run", action="store_true", help="only list them")
    clean.add_argument("--all", action="store_true",
                       help="also end runs whose launcher (a notebook, a terminal) is still alive")
    sl = sub.add_parser("slurm", help="print a Slurm sbatch script for a multi-node run of SCRIPT")
    sl.add_argument("script")
    sl.add_argument("--nodes", default=2, help="nodes (default 2)")
    sl.add_argument("--gpus-per-node", help="GPUs (ranks) per node (default 4)")
    sl.add_argument("--cpu", action="store_true", help="a CPU partition: no GPUs, ranks on gloo")
    sl.add_argument("--nproc-per-node", help="with --cpu: CPU ranks per node (default 2)")
    sl.add_argument("--port", default=None,
                    help="rendezvous port on the first node (default: 20000 + job id %% 20000)")
    sl.add_argument("--time", default="01:00:00", help="time limit (default 01:00:00)")
    sl.add_argument("--partition", help="Slurm partition")
    return top


def follow(run, out=sys.stdout, err=sys.stderr):
    """Echo the ranks' output while the run goes: rank 0 as it is (its progress bar
    included), other ranks prefixed with [rankN]."""
    for update in monitor.Monitor(run, log_lines=0, output=True).updates(interval=0.2):
        for rank, stream, text in update.output:
            target = out if stream == "stdout" else err
            if rank == 0 and stream == "stdout":
                target.write(text)
            else:
                target.write("".join(f"[rank{rank}] {line}\n" for line in text.splitlines()))
            target.flush()
    return run.result


def report(run, out=sys.stdout, err=sys.stderr, echoed=False):
    """The ending; when the ranks' output was echoed, their tracebacks were shown already."""
    res = run.result
    status = res["status"]
    if status == "ok":
        print(f"\nrun ok in {res['duration_s']:.1f} s; run directory: {run.run_dir}", file=out)
    else:
        print(f"\nrun {status} after {res['duration_s']:.1f} s; run directory: {run.run_dir}", file=err)
        message = res.get("message", "")
        if res.get("failure"):
            message = failures.describe(res["failure"], traceback=not echoed)
            if run.config.get("launch", {}).get("mode") == "warm":
                message += "\n" + launch.WARM_NOTE
        print(message, file=err)
    return EXIT[status]


def announce(run, out=sys.stdout):
    """The first line: what runs where, warm or cold (and why cold), and the run directory."""
    print(f"run: {monitor.where(run.config)}, {monitor.launch_text(run.config)} launch; "
          f"run directory {run.run_dir}", file=out, flush=True)


def supervise(run, quiet=False):
    if not quiet:
        announce(run)
    if run.config.get("nnodes") == 1 and not (run.config.get("isolation") or {}).get("private_network"):
        print(f"warning: {isolation.status().line()}", file=sys.stderr, flush=True)   # the run's first line
    try:
        if quiet:
            run.wait()
        else:
            follow(run)
    except KeyboardInterrupt:
        run.stop()
    return report(run, echoed=not quiet)


def cmd_run(a, script_args):
    spec = Spec(a.script, devices.Request(a.nproc, a.gpus, a.cpu), args=script_args,
                max_restarts=a.max_restarts, timeout=a.timeout,
                nodes=Nodes(a.nnodes, a.node_rank, a.rdzv_endpoint), cold=a.cold)
    return supervise(launch.run(spec, a.run_dir), a.quiet)


def cmd_demo(a):
    epochs = validate.number("--epochs", a.epochs, 1)
    # notebook 03's script, the course's one reference loop; batch 64: half the steps of its default
    spec = Spec(script("ddp_basic.py"), devices.Request(a.nproc, a.gpus, a.cpu),
                args=["--epochs", str(epochs), "--batch-size", "64"], label="demo", cold=a.cold)
    run = launch.run(spec, a.run_dir)
    print(f"demo: {epochs} epoch(s)", flush=True)
    code = supervise(run)
    if code == 0:
        from .launcher.runs import load
        rec = load(run.run_dir)
        s = rec.summary()
        acc = s["final_accuracy"]
        print(f"summary: test accuracy {acc:.1%} (chance is 10%), final loss {s['final_loss']:.3f}, "
              f"{rec.last('epoch_s') or 0:.1f} s per epoch" if acc is not None
              else "summary: no metrics were written")
    return code


def _interrupt(signum, frame):
    """SIGTERM to this process ends the run like Ctrl-C does."""
    raise KeyboardInterrupt


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        a = build_parser().parse_args(argv)
        if a.command == "run":
            return cmd_run(a, script_args)
        if a.command == "demo":
            return cmd_demo(a)
        if a.command == "doctor":
            from .launcher import doctor
            return doctor.main()
        if a.command == "slurm":
            from .launcher import slurm
            print(slurm.from_flags(a, script_args), end="")
            return 0
        if a.command == "cleanup":
            from .launcher import doctor
            return doctor.cleanup(dry_run=a.dry_run, everything=a.all)
    except BadInput as e:
        print(f"ddp_lesson: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
