"""The distributed lessons run twice under `python -m pytest`: at the default 2 CPU ranks
and again at 3, as on a machine with 3 GPUs, so nothing in them may assume 2.

Each notebook in RERUN is collected a second time as `NN_name.ipynb[3ranks]`: a real nbval
execution of every cell (asserts included) in a kernel started with DDP_LESSON_NPROC=3.
`-k "not 3ranks"` leaves the reruns out while you work on one notebook.
"""
import os

import pytest

RERUN = {"02_loss_averaging.ipynb", "03_ddp_torchrun.ipynb", "03b_ddp_equals_one_process.ipynb",
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
    return AtNproc.from_parent(parent, path=file_path, name=name, nodeid=base + name)

