"""Speed-up and efficiency vs number of ranks, with the time of a step split into compute
and all-reduce, and a two-term model that predicts the speed-up; all measured in one run.

    python bench/scaling.py [--nprocs 1,2,4] [--quick] [--samples N] [--cpu] [--save FILE]

One launch per rank count; what is measured and the model are described in
ddp_lesson.launcher.scaling (notebook 06 uses the same code). `--save FILE` writes the rows and their
provenance (date, cores, CPU model, load average at the start and the end, torch version) as
JSON; notebook 06 prints bench/reference/scaling_cpu.json beside the learner's run, made by
    python bench/scaling.py --cpu --quick --nprocs 1,2,4 --save bench/reference/scaling_cpu.json
"""
import argparse
import sys
import time

from ddp_lesson.launcher import scaling


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", help="comma-separated rank counts (default 1,2,4 on CPU, powers of 2 up to the GPUs)")
    p.add_argument("--quick", action="store_true", help="small epoch (CI)")
    p.add_argument("--samples", type=int, help="training samples in the epoch (default 32768, --quick 8192)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks on gloo even where GPUs exist")
    p.add_argument("--save", help="write the rows and their provenance to this JSON file")
    a = p.parse_args(argv)
    t = time.perf_counter()
    nprocs = [int(x) for x in a.nprocs.split(",")] if a.nprocs else None
    if a.quick and not nprocs:
        nprocs = [1, 2]
    start = scaling.provenance()
    rows = scaling.measure(nprocs, quick=a.quick, cpu=a.cpu, samples=a.samples)
    scaling.report(rows)
    if a.save:
        prov = scaling.provenance(start, argv=["bench/scaling.py"] + list(sys.argv[1:] if argv is None else argv))
        scaling.save_reference(a.save, rows, prov)
        print(f"saved to {a.save}:", scaling.describe_provenance(prov))
    print(f"{time.perf_counter() - t:.1f} s in all (timings on a shared machine are noisy)")


if __name__ == "__main__":
    main()
