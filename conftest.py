"""How `python -m pytest` runs: in parallel workers (pytest-xdist, `-n auto --dist loadfile`
in pyproject.toml), longest files first, and the distributed lessons twice.

Parallel: one worker per core plus one (at most 8), because many tests mostly wait (a hang
until its timeout, a Slurm job, a browser) while others compute. Each test file, and each
notebook (its rerun too), goes whole to one worker, in order: a notebook's cells share a
kernel, and a module's fixtures are built once. `-n 0` runs everything in this process.

The distributed lessons run twice under `python -m pytest`: at the default 2 CPU ranks
and again at 3, as on a machine with 3 GPUs, so nothing in them may assume 2.

Each notebook in RERUN is collected a second time as `NN_name.ipynb::3ranks`: a real nbval
execution of every cell (asserts included) in a kernel started with DDP_LESSON_NPROC=3.
`-k "not 3ranks"` leaves the reruns out while you work on one notebook.
"""
import os

import pytest

# The longest files first (seconds in the last fresh-clone run, 2 cores), so that none starts
# last and keeps the others waiting; this changes only the order, never what runs.
LONG_FIRST = [
    "tests/test_warm.py", "tests/test_warm_fidelity.py",
    "notebooks/11_capstone_gpt.ipynb", "tests/test_netns.py", "tests/test_cli.py", "tests/test_take_home.py",
    "tests/test_bench_quick.py", "notebooks/07_troubleshooting.ipynb", "notebooks/10_beyond_ddp.ipynb",
    "notebooks/09_collectives_and_ddp_from_scratch.ipynb", "notebooks/03b_ddp_equals_one_process.ipynb",
    "notebooks/05_gradient_accumulation.ipynb", "notebooks/04_sync_batchnorm.ipynb",
    "notebooks/08_multi_node.ipynb", "notebooks/06_scaling_and_performance.ipynb",
    "notebooks/03_ddp_torchrun.ipynb", "notebooks/03c_averaging_in_ddp.ipynb", "tests/test_lessons_03_05.py", "tests/test_lesson_09.py",
    "tests/test_launch.py", "tests/test_browser.py", "tests/test_lesson_10.py", "tests/test_world_size.py",
    "tests/test_world_abuse.py", "tests/test_launch_stress.py", "notebooks/00_start_here.ipynb",
    "tests/test_timeout_diagnosis.py", "tests/test_hub.py", "tests/test_data.py", "tests/test_timing.py",
    "tests/test_run_processes.py",
]

RERUN = {"03_ddp_torchrun.ipynb", "03b_ddp_equals_one_process.ipynb", "03c_averaging_in_ddp.ipynb",
         "04_sync_batchnorm.ipynb",
         "05_gradient_accumulation.ipynb"}
NPROC = 3


def pytest_collect_file(file_path, parent):
    opt = parent.config.option
    if not (getattr(opt, "nbval", False) or getattr(opt, "nbval_lax", False)):
        return None
    if file_path.name not in RERUN or file_path.parent.name != "notebooks":
        return None
    from nbval.plugin import IPyNbFile

    class AtNproc(IPyNbFile):
        def setup(self):
            # the kernel inherits the environment it is started with, and the course's
            # default rank count comes from DDP_LESSON_NPROC
            before = os.environ.get("DDP_LESSON_NPROC")
            os.environ["DDP_LESSON_NPROC"] = str(NPROC)
            try:
                super().setup()
            finally:
                if before is None:
                    del os.environ["DDP_LESSON_NPROC"]
                else:
                    os.environ["DDP_LESSON_NPROC"] = before
            # a rerun that silently ran at the default would prove nothing
            reply = self.kernel.kc.execute_interactive(
                f"import os; assert os.environ.get('DDP_LESSON_NPROC') == '{NPROC}'", timeout=60)
            if reply["content"]["status"] != "ok":
                pytest.fail(f"the kernel for {self.name} did not get DDP_LESSON_NPROC={NPROC}")

    name = f"{file_path.name}[{NPROC}ranks]"
    base = parent.nodeid + "/" if parent.nodeid else ""
    # nodeid "notebooks/NN.ipynb::3ranks": xdist's loadfile puts the rerun in the same group
    # as the first run, one after the other, since both write the same work/ files
    return AtNproc.from_parent(parent, path=file_path, name=name,
                               nodeid=f"{base}{file_path.name}::{NPROC}ranks")



def pytest_xdist_auto_num_workers(config):
    return min(len(os.sched_getaffinity(0)) + 1, 8)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))   # stable: cells stay in order


_NOTEBOOK_SECONDS = {}
_CPU_SECONDS = {}     # test file (a notebook's rerun apart) -> CPU seconds


def _cpu_now():
    t = os.times()   # this process, and the children it has waited for (a kernel and its torchruns)
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _count_cpu(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _count_cpu(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _count_cpu(item, "teardown")


def _count_cpu(item, when):
    start = _cpu_now()
    yield
    item.user_properties.append((f"cpu_s:{when}", _cpu_now() - start))   # the phase's report carries it


def _group(nodeid):
    path = nodeid.split("::", 1)[0]
    return path + ("::3ranks" if "::3ranks::" in nodeid else "")


def pytest_runtest_logreport(report):
    # in xdist's controller too: every worker's reports come back there
    key = _group(report.nodeid)
    if key.split("::", 1)[0].endswith(".ipynb"):
        _NOTEBOOK_SECONDS[key] = _NOTEBOOK_SECONDS.get(key, 0.0) + report.duration
    cpu = dict(report.user_properties).get(f"cpu_s:{report.when}", 0.0)
    _CPU_SECONDS[key] = _CPU_SECONDS.get(key, 0.0) + cpu


def pytest_terminal_summary(terminalreporter):
    """Each notebook's headless time (kernel start and every cell), for bench/RESULTS.md.
    Measured while other workers share the cores, so an upper bound of its time alone.
    Then where the CPU goes: on 2 cores the suite is CPU-bound, so CPU seconds, not the
    wall time of one test, say what a change saves."""
    if _NOTEBOOK_SECONDS:
        terminalreporter.section("notebook times (all cells, kernel start included)")
        for name, seconds in sorted(_NOTEBOOK_SECONDS.items()):
            terminalreporter.write_line(f"{seconds:7.1f} s  {name}")
    if _CPU_SECONDS:
        total = sum(_CPU_SECONDS.values())
        terminalreporter.section(f"CPU seconds by file ({total:.0f} s in all; processes a test "
                                 "waited for are counted, orphans are not)")
        for name, seconds in sorted(_CPU_SECONDS.items(), key=lambda kv: -kv[1])[:30]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {name}")
