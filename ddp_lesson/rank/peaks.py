"""The hardware's peak FLOP/s, MFU's denominator, for lesson 11's capstone (gpt_ddp.py): a GPU's
from the vendors' datasheets (the table below), a CPU's from its flags and clock; and the rate
back-to-back matmuls achieve, which the capstone's check compares with the peak. Rank side:
gpt_ddp.py imports it where the course is installed, and logs no MFU without it.
"""
import os
import re
import time

import torch

# dense fp16/bf16 tensor-core peaks from the vendors' datasheets (FLOP/s; "dense": without the
# 2x "with sparsity" figure, which needs 2:4 structured zeros). SXM (the socketed server module)
# unless PCIe (a plug-in card) or NVL (H100/H200 NVL cards) is named. GeForce: the FP32-accumulate
# figure (the sheets also give 2x for FP16 accumulate), since PyTorch's fp16 matmuls accumulate in
# fp32 unless torch.backends.cuda.matmul.allow_fp16_accumulation is set. The FLOP/s of autocast's
# matmuls, not of fp32 ones. The T4 and V100 have no bf16 tensor cores: fp16 only (NO_BF16).
# A GPU not in the table (A10G: no NVIDIA datasheet; GH200, H800, RTX A6000, a MIG slice...) gets no
# peak and no MFU: add its dense figure here. A CPU's peak comes from the CPU itself: cpu_peak().
DATASHEET_PEAK = {"H200": 989e12, "H200 NVL": 835e12, "H100": 989e12, "H100 NVL": 835e12,
                  "H100 PCIe": 756e12, "A100": 312e12, "L40S": 362e12, "L40": 181e12, "A10": 125e12,
                  "L4": 121e12, "V100": 125e12, "V100 PCIe": 112e12, "V100S": 130e12,
                  "RTX 4090": 165e12, "RTX 3090": 71e12, "T4": 65e12}
NO_BF16 = {"T4", "V100", "V100 PCIe", "V100S"}


def datasheet_peak(name, dtype=torch.float16):
    """The table's entry for a name as torch.cuda.get_device_name() gives it, in three tries,
    upper or lower case alike: the whole name ("NVIDIA L40" is "L40"; an L40S is not an L4);
    then without memory words (-80GB, HBM3: "NVIDIA H100 80GB HBM3" is "H100", "Tesla
    V100-PCIE-16GB" is "V100 PCIe"); then without form-factor words too (SXM4, PCIe:
    "NVIDIA A100 80GB PCIe" and "NVIDIA A100-SXM4-40GB" are "A100"). Any other word (the "D"
    of an RTX 4090 D, the "Ti" of a 3090 Ti, a MIG profile) makes it another device: None,
    as for a device not in the table or a dtype it has no peak for."""
    words = [w for w in name.replace("-", " ").split() if w.upper() not in ("NVIDIA", "TESLA", "GEFORCE")]
    no_memory = [w for w in words if not re.fullmatch(r"\d+GB|HBM\d*E?", w, re.I)]
    no_board = [w for w in no_memory if not re.fullmatch(r"SXM\d*|PCIE", w, re.I)]
    table = {key.upper(): key for key in DATASHEET_PEAK}
    for left in (words, no_memory, no_board):
        key = table.get(" ".join(left).upper())
        if key:
            return None if dtype == torch.bfloat16 and key in NO_BF16 else DATASHEET_PEAK[key]
    return None


# FLOP per cycle per core of the widest multiply-add units the CPU flags name, fp32 unless said:
# AVX-512 (avx512f): 2 FMA units x 16 fp32 lanes x 2 (a multiply and an add), as on Xeon Gold 6xxx,
# Platinum and Zen 5. AMD Zen 4 (AuthenticAMD, cpu family 25, avx512f: Zen 3 has no AVX-512, Zen 5
# is family 26) runs 512-bit FMAs on 256-bit units: half, 32 (bf16: 64); cpu_peak halves it.
# Xeon Bronze, Silver and most Gold 5xxx also flag avx512f but do 32: there this peak is 2x too
# high, and no flag tells. AVX2 with FMA: 2 x 8 x 2; else SSE: a 4-lane multiply
# and a 4-lane add per cycle. bf16: AMX (amx_bf16) 1024, as Intel states for its tile unit;
# AVX512_BF16's dot product 2 x 16 x 2 x 2; else bf16 runs on the fp32 units.
FLOP_PER_CYCLE = [("amx_bf16", "bf16", 1024), ("avx512_bf16", "bf16", 128),
                  ("avx512f", "fp32", 64), ("fma", "fp32", 32), ("sse", "fp32", 8)]


def read_cpu():
    """(the first "flags" line of /proc/cpuinfo, split; clock in MHz; where the clock is from),
    or None where there is no such file or line (macOS; ARM names its units otherwise)."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    flags, mhz = re.search(r"^flags\s*:(.*)$", info, re.M), re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)
    if not flags:
        return None
    flags = flags.group(1).split()
    max_freq = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"    # kHz, where the OS exposes it
    if os.path.exists(max_freq):
        return flags, int(open(max_freq).read()) / 1e3, max_freq
    return (flags, float(mhz.group(1)), "/proc/cpuinfo cpu MHz") if mhz else None


def read_cpu_id():
    """(vendor_id, cpu family) from /proc/cpuinfo, or (None, None)."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    vendor, family = re.search(r"^vendor_id\s*:\s*(\S+)", info, re.M), re.search(r"^cpu family\s*:\s*(\d+)", info, re.M)
    return (vendor.group(1) if vendor else None), (int(family.group(1)) if family else None)


def cpu_peak(dtype, cores, flags, mhz, cpu_id=(None, None)):
    """(FLOP/s, inputs): cores x clock x FLOP/cycle of the widest multiply-add unit for dtype;
    halved for AVX-512 on Zen 4 (cpu_id: vendor and family, as read_cpu_id gives them)."""
    kind = "bf16" if dtype == torch.bfloat16 else "fp32"
    unit, per_cycle = next((f, n) for f, k, n in FLOP_PER_CYCLE
                           if (f in flags or f == "sse") and (k == kind or k == "fp32"))
    if tuple(cpu_id) == ("AuthenticAMD", 25) and unit.startswith("avx512"):
        unit, per_cycle = f"{unit} on Zen 4's 256-bit units", per_cycle // 2
    return cores * mhz * 1e6 * per_cycle, {"cores": cores, "mhz": mhz, "unit": unit, "flop_per_cycle": per_cycle}


def peak_rate(device, dtype):
    """(FLOP/s or None, where from, inputs): the hardware's peak for this rank, MFU's denominator.
    A GPU: its dense fp16/bf16 datasheet figure (None if not in the table). A CPU: the cores
    this rank may use (its threads, at most its share of the cores the OS lets the job run on)
    x clock x FLOP/cycle of the widest multiply-add units the CPU's flags name."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_peak(name, dtype) if dtype in (torch.float16, torch.bfloat16) else None
        if peak:
            return peak, f"datasheet ({name}, dense {str(dtype).split('.')[-1]})", {}
        return None, f"no datasheet peak for {name} in {str(dtype).split('.')[-1]}: add it to DATASHEET_PEAK", {}
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = min(torch.get_num_threads(), len(os.sched_getaffinity(0)) / ranks_here)
    if not read_cpu():
        return None, "no CPU peak: no x86 flags and clock in /proc/cpuinfo", {}
    flags, mhz, clock_from = read_cpu()
    peak, inputs = cpu_peak(dtype, cores, flags, mhz, read_cpu_id())
    return peak, (f"CPU peak: {cores:g} core(s) x {mhz:.0f} MHz ({clock_from}) x {inputs['flop_per_cycle']} "
                  f"FLOP/cycle ({inputs['unit']})"), dict(inputs, clock_from=clock_from)


def achievable_rate(device, dtype, window_s, windows=5):
    """FLOP/s of back-to-back n x n matmuls, over `windows` windows of window_s seconds each (a
    step's length): what this rank reaches on one large, clean matrix product, with its threads,
    under the load of the moment. An achieved rate, not a peak: its spread shows the load.
    Returns (per wall-clock second, per CPU-second of this process): the second is what one
    core reached, whatever the load, which check_peak compares with the peak per core."""
    n = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    rates, cpu_rates = [], []
    for _ in range(windows):
        count, start, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < window_s:
            a @ b
            if a.is_cuda:
                torch.cuda.synchronize(device)
            count += 1
        rates.append(2 * n ** 3 * count / (time.perf_counter() - start))
        cpu_rates.append(2 * n ** 3 * count / max(time.process_time() - cpu, 1e-9))
    return sorted(rates), sorted(cpu_rates)
