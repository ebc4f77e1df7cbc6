"""Device planning (`ddp_lesson.launcher.devices.plan`): which ranks a run gets, without CUDA.

- with GPUs (a fake list passed as `available=`): one process per GPU, nccl,
  CUDA_VISIBLE_DEVICES with the physical ids in PCI bus order; a subset by `gpus=` as a
  list or as "0,1"; `cpu=True` forces gloo CPU ranks;
- with no GPU: gloo, 2 CPU processes by default, CUDA hidden, OMP threads shared out;
- bad requests raise BadInput with one sentence (ends with '.', no newline), before
  anything starts;
- `list_gpus()` parses nvidia-smi's CSV output (a fake nvidia-smi on PATH);
- a devices.Request holds one shape whatever the caller passed (a list or "0,1"; nproc the
  GPU count); a Plan gives back the Request that pins it; config.json's devices is always a
  list, [] for CPU ranks, and spec.gpus() reads it.
"""
import os
import stat
import warnings

import pytest

from ddp_lesson import BadInput
from ddp_lesson.launcher import devices
from ddp_lesson.launcher.devices import GPU, plan

GPUS = [GPU(0, "Fake A100", 81920, 10), GPU(1, "Fake A100", 81920, 10),
        GPU(2, "Fake A100", 81920, 30000, processes=[(123, 29000)])]


def one_sentence(err):
    text = str(err.value)
    assert "\n" not in text and text.endswith("."), text
    assert text[0].isupper() or text.startswith("--"), text
    return text


def test_all_free_gpus_by_default():
    p = plan(available=GPUS)                 # GPU 2 is busy: the default leaves it out
    assert (p.nproc, p.gpus, p.backend) == (2, [0, 1], "nccl")
    assert p.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert "2 rank(s) on GPU(s) 0,1 with nccl" == p.describe()
    p = plan(available=GPUS[:2] + [GPU(2, "Fake A100", 81920, 10)])
    assert p.gpus == [0, 1, 2] and "3 rank(s) on GPU(s) 0,1,2 with nccl" == p.describe()


@pytest.mark.parametrize("gpus", ["0,2", " 0 , 2 ", [0, 2], (0, 2)])
def test_gpu_subset(gpus):
    p = plan(gpus=gpus, available=GPUS)
    assert (p.nproc, p.gpus, p.backend) == (2, [0, 2], "nccl")
    assert p.env["CUDA_VISIBLE_DEVICES"] == "0,2"


def test_nproc_takes_the_first_gpus():
    p = plan(nproc=2, available=GPUS)
    assert p.gpus == [0, 1] and p.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_cpu_forced_even_with_gpus():
    p = plan(nproc=3, cpu=True, available=GPUS)
    assert (p.nproc, p.gpus, p.backend) == (3, [], "gloo")
    assert p.env["CUDA_VISIBLE_DEVICES"] == ""


def test_no_gpu_means_two_gloo_cpu_processes(monkeypatch):
    monkeypatch.setattr(devices, "cpu_count", lambda: 8)
    p = plan(available=[])
    assert (p.nproc, p.gpus, p.backend) == (2, [], "gloo")
    assert p.env == {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "4"}
    assert p.describe() == "2 CPU process(es) with gloo"
    assert plan(nproc="4", available=[]).nproc == 4
    monkeypatch.setattr(devices, "cpu_count", lambda: 1)
    assert plan(available=[]).nproc == 1  # one core: one process by default
    assert plan(nproc=3, available=[]).env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("nproc, words", [(0, "at least 1"), (-1, "at least 1"), ("0", "at least 1"),
                                          ("abc", "whole number"), ("1.5", "whole number"),
                                          (True, "whole number")])
def test_bad_nproc(nproc, words):
    with pytest.raises(BadInput) as err:
        plan(nproc=nproc, available=[])
    assert words in one_sentence(err)


@pytest.mark.parametrize("kwargs, words", [
    ({"gpus": "0"}, "no NVIDIA GPU"),                       # no GPU here
    ({"gpus": "0,5"}, "GPU 5 does not exist"),
    ({"gpus": "a,b"}, "like 0,1"),
    ({"gpus": ""}, "No GPU was selected"),
    ({"gpus": "0,0"}, "must not repeat"),
    ({"gpus": "0,1", "nproc": 3}, "One process per GPU"),
    ({"nproc": 4}, "at most 2"),
])
def test_bad_gpu_requests(kwargs, words):
    available = [] if kwargs == {"gpus": "0"} else GPUS
    with pytest.raises(BadInput) as err:
        plan(available=available, **kwargs)
    assert words in one_sentence(err)


def test_gpu_label():
    assert GPUS[2].busy and not GPUS[0].busy
    assert GPUS[2].label() == "GPU 2: Fake A100, 80 GiB (30000 MiB used), in use by 1 process(es)"


def _fake_nvidia_smi(tmp_path, monkeypatch):
    """Two H100s, GPU 0 busy (pid 4242): the fake of _fake_gpus below."""
    _fake_gpus(tmp_path, monkeypatch, "1, Fake H100, 81559, 5, GPU-bbb\\n0, Fake H100, 81559, 20000, GPU-aaa\\n",
               "GPU-aaa, 4242, 19990\\n")


def test_list_gpus_from_nvidia_smi(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch)
    gpus = devices.list_gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].processes == [(4242, 19990)] and gpus[1].processes == []
    assert gpus[0].memory_total_mb == 81559 and gpus[0].uuid == "GPU-aaa"
    p = plan()  # found through the fake nvidia-smi; GPU 0 is busy, so one free GPU: CPU ranks
    assert p.env["CUDA_VISIBLE_DEVICES"] == "" and p.backend == "gloo"
    assert plan(gpus="0,1").env["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize("setting, expected", [
    ("1", [1]), ("GPU-aaa", [0]), ("1,0", [1, 0]), ("", []), ("0,7,1", [0]),
    ("0,0", []), ("1gpu,0", [1, 0]), ("+1", [1]), ("-0,1", [0, 1]), ("1,,0", [1]), ("x,1", []),
    ("GPU-bbb,GPU-aaa", [1, 0]),
])
def test_cuda_visible_devices_of_the_caller_narrows_the_gpus(tmp_path, monkeypatch, setting, expected):
    """An instructor gives a learner GPUs with CUDA_VISIBLE_DEVICES; the picker and the
    launcher must stay inside them, read as torch reads the list (devices.visible_ids, checked
    against torch's parser in test_visible_ids_agrees_with_torch)."""
    _fake_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", setting)
    assert [g.index for g in devices.list_gpus()] == expected
    if expected:
        default = plan().env["CUDA_VISIBLE_DEVICES"]          # GPU 0 is busy: at most one free GPU
        assert default == ""                                  # so CPU ranks by default
        assert plan(gpus=expected).env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, expected))
        with pytest.raises(BadInput, match="does not exist"):
            plan(gpus=[2])


@pytest.mark.parametrize("setting, words", [("MIG-xyz", "MIG"), ("0,+", "cannot read"), ("+x", "cannot read")])
def test_a_list_the_course_cannot_read_warns_and_shows_no_gpu(tmp_path, monkeypatch, setting, words):
    # torch counts a MIG slice through the CUDA runtime, and fails on "0,+": the course shows
    # no GPU for either, so plan() goes to CPU ranks, and it says so rather than silently
    _fake_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", setting)
    with pytest.warns(UserWarning, match=words):
        assert devices.list_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [g.index for g in devices.list_gpus()] == [1]     # a list it reads: no warning


def test_no_nvidia_smi_means_no_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert devices.list_gpus() == []


# -- one number validator (issue 10/11) -------------------------------------------------------

def test_launch_and_devices_say_the_same_sentence(tmp_path):
    from ddp_lesson.launcher import launch
    with pytest.raises(BadInput) as a:
        plan(nproc="abc", available=[])
    with pytest.raises(BadInput) as b:
        launch.start(__file__, nproc="abc", run_dir=tmp_path / "r")
    assert str(a.value) == str(b.value) == "--nproc must be a whole number, got 'abc'."
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan")])
def test_non_finite_timeouts_are_refused(tmp_path, value):
    from ddp_lesson.launcher import launch
    with pytest.raises(BadInput) as err:
        launch.start(__file__, nproc=1, timeout=value, run_dir=tmp_path / "r")
    assert "--timeout must be a finite number" in one_sentence(err)


def test_cpu_ranks_far_beyond_the_machine_are_refused_unless_asked_on_purpose(monkeypatch):
    monkeypatch.setattr(devices, "cpu_count", lambda: 2)
    monkeypatch.delenv("DDP_LESSON_MAX_CPU_RANKS", raising=False)
    assert plan(nproc=8, available=[]).nproc == 8
    with pytest.raises(BadInput) as err:
        plan(nproc=100000, available=[])
    assert "DDP_LESSON_MAX_CPU_RANKS=100000" in one_sentence(err)
    monkeypatch.setenv("DDP_LESSON_MAX_CPU_RANKS", "100000")
    assert plan(nproc=100000, available=[]).nproc == 100000


def test_one_description_of_a_plan():
    assert devices.describe(2, [], "gloo") == plan(nproc=2, available=[]).describe()


# -- one shape for the devices asked and the devices a run had (issue 33) ---------------------

def test_a_request_holds_one_shape_whatever_was_passed():
    from ddp_lesson.launcher.devices import Request
    assert Request(gpus="0, 2") == Request(gpus=[0, 2]) == Request(nproc="2", gpus=("0", 2))
    assert Request(gpus="0,2").gpus == (0, 2) and Request(gpus="0,2").nproc == 2
    assert Request(nproc=3, gpus=[0, 1], cpu=True) == Request(nproc=3, cpu=True)   # cpu: gpus unused
    assert Request() == Request(None, None, False) and Request().nproc is None
    with pytest.raises(BadInput) as err:
        Request(gpus=[0, "x"])
    assert one_sentence(err) == "--gpus must be a whole number, got 'x'."
    with pytest.raises(BadInput) as err:
        Request(gpus=3)
    assert "like [0, 1]" in one_sentence(err)


@pytest.mark.parametrize("asked", [{"gpus": "2,0"}, {"nproc": 2}, {"cpu": True, "nproc": 3}, {}])
def test_a_plan_gives_back_the_request_that_pins_it(asked):
    first = plan(available=GPUS, **asked)
    again = first.request().plan(available=GPUS)
    assert (again.nproc, again.gpus, again.backend, again.env) == (first.nproc, first.gpus, first.backend, first.env)
    assert first.request().cpu == (not first.gpus)


def test_config_devices_is_always_a_list(tmp_path):
    from ddp_lesson.launcher import spec
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    cpu = spec.fields(spec.Spec(script), plan(nproc=2, cpu=True, available=GPUS))
    gpu = spec.fields(spec.Spec(script), plan(gpus="2,0", available=GPUS))
    assert (cpu["devices"], cpu["backend"], cpu["nproc"]) == ([], "gloo", 2)
    assert (gpu["devices"], gpu["backend"], gpu["nproc"]) == ([2, 0], "nccl", 2)
    assert spec.gpus(cpu) == [] and spec.gpus(gpu) == [2, 0]
    assert spec.gpus({"devices": []}) == [] and spec.gpus({}) == [] and spec.gpus(None) == []
    assert devices.describe(2, spec.gpus(gpu), "nccl") == "2 rank(s) on GPU(s) 2,0 with nccl"


# -- no device choice given: one policy (devices.default_gpus) for every entry point --------
def _fake_gpus(tmp_path, monkeypatch, gpu_rows, app_rows=""):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"""#!/bin/sh
case "$1" in
  --query-gpu=*) printf '{gpu_rows}' ;;
  --query-compute-apps=*) printf '{app_rows}' ;;
esac
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


ONE_GPU = ("0, Fake RTX 4090, 24564, 5, GPU-one\\n", "")
TWO_ONE_BUSY = ("0, Fake A100, 81920, 30000, GPU-zero\\n1, Fake A100, 81920, 5, GPU-one\\n",
                "GPU-zero, 4242, 29990\\n")       # someone else's process holds GPU 0


@pytest.mark.parametrize("n_gpus, expected", [(0, []), (1, []), (2, [0, 1]), (3, [0, 1])])
def test_default_gpus_policy(n_gpus, expected):
    # GPUS[2] is busy: the default counts only the GPUs nobody else uses, two or more of them
    assert devices.default_gpus(GPUS[:n_gpus]) == expected


def test_busy_gpus_leave_the_default():
    free, busy = GPU(0, "A", 1, 0), GPU(1, "A", 1, 9, processes=[(7, 9)])
    assert devices.default_gpus([free, busy]) == []               # one free GPU: CPU ranks
    assert devices.default_gpus([busy, busy]) == []
    assert plan(available=[free, busy]).gpus == [] and plan(gpus=[1], available=[free, busy]).gpus == [1]


@pytest.mark.parametrize("machine", ["one GPU", "two GPUs, one busy"])
@pytest.mark.parametrize("nproc_env", [None, "3"])
def test_every_entry_point_defaults_to_cpu_ranks_with_fewer_than_two_free_gpus(tmp_path, monkeypatch,
                                                                               nproc_env, machine):
    """A fake machine with one GPU, or with two of which another process uses one: the picker,
    `%ranks start`, the command line and plan() with nothing asked all give default_cpu_nproc()
    CPU ranks on gloo; asking for GPU 0 uses it."""
    _fake_gpus(tmp_path, monkeypatch, *(ONE_GPU if machine == "one GPU" else TWO_ONE_BUSY))
    monkeypatch.setattr(devices, "cpu_count", lambda: 8)
    if nproc_env:
        monkeypatch.setenv("DDP_LESSON_NPROC", nproc_env)
    else:
        monkeypatch.delenv("DDP_LESSON_NPROC", raising=False)
    assert len(devices.list_gpus()) == (1 if machine == "one GPU" else 2)
    want = devices.default_cpu_nproc()
    assert want == int(nproc_env or 2)

    from ddp_lesson.__main__ import build_parser
    from ddp_lesson.notebook import magics
    from ddp_lesson.notebook.widgets import DevicePicker

    got = {"plan()": plan()}
    a = build_parser().parse_args(["run", "train.py"])                     # python -m ddp_lesson run train.py
    got["command line"] = devices.Request(a.nproc, a.gpus, a.cpu).plan()
    asked = {}

    def fake_start(**kwargs):                                             # what `%ranks start` asks the world for
        asked.update(kwargs)
        raise ValueError("not started in this test")

    monkeypatch.setattr(magics.world_mod, "start", fake_start)
    with pytest.raises(Exception, match="not started in this test"):
        magics.RanksMagics(shell=None)._command(["start"])
    asked.pop("timeout")
    got["%ranks start"] = devices.Request(**asked).plan()
    got["picker"] = devices.Request(**DevicePicker().selection()).plan()  # what the run panel launches
    for where, p in got.items():
        assert (p.nproc, p.gpus, p.backend) == (want, [], "gloo"), (where, p)
    assert plan(gpus="0").gpus == [0] and plan(gpus="0").backend == "nccl"   # asked for: the GPU
    b = build_parser().parse_args(["run", "train.py", "--gpus", "0"])
    assert devices.Request(b.nproc, b.gpus, b.cpu).plan().gpus == [0]


# -- CUDA_VISIBLE_DEVICES: one parser, torch's reading ------------------------------------
TORCH_CASES = ["0,0", "2gpu,3", "+1", "-0,1", "1,,2", "x,1", "2,3", "1, 4,6", "0,9,1", "", "-1,0",
               "0,9,0", " 3 ,1 ", "GPU-bbbb,GPU-aaaa1", "GPU-cccc,GPU-cccc4444", "GPU-dddd",
               # torch looks for a repeated string before it matches any UUID
               "GPU-aaaa,GPU-zz,GPU-aaaa", "GPU-aaaa1111,GPU-aaaa,GPU-aaaa1111", "GPU-bbbb,GPU-zz,GPU-bbbb",
               # a bare sign: torch's parser raises ValueError, and so must the course's
               "0,+", "0,-", "+x,1", "0,0,+"]
TORCH_UUIDS = ["GPU-aaaa1111", "GPU-aaaa2222", "GPU-bbbb3333", "GPU-cccc4444"]


@pytest.mark.parametrize("visible", TORCH_CASES)
@pytest.mark.parametrize("n", [4, 8])
def test_visible_ids_agrees_with_torch(visible, n, monkeypatch):
    """The oracle is the installed torch: _parse_visible_devices reads the variable, then
    _device_count_nvml cuts it with the machine's GPU count (NVML faked)."""
    import torch.cuda
    uuids = (TORCH_UUIDS * 2)[:n]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: n)
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: uuids)
    try:
        parsed = torch.cuda._parse_visible_devices()
    except ValueError:
        with pytest.raises(ValueError, match="sign with no digit"):
            devices.visible_ids(visible, n, uuids)
        return
    count = max(torch.cuda._device_count_nvml(), 0)
    ids = devices.visible_ids(visible, n, uuids)
    assert len(ids) == count, (parsed, count, ids)
    if parsed and isinstance(parsed[0], int):
        assert ids == parsed[:count]
    elif parsed:
        assert ids == torch.cuda._transform_uuid_to_ordinals(parsed, uuids)[:count]


def test_the_picture_uses_the_one_parser():
    from ddp_lesson.notebook import diagrams
    assert diagrams.visible_ids is devices.visible_ids
