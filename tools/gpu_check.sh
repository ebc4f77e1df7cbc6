#!/usr/bin/env bash
# GPU check: run on a machine with NVIDIA GPUs (1 to 8), from the repository root or anywhere:
#     bash tools/gpu_check.sh
# Runs doctor, the demo on the first GPU, nccl all_reduce on every visible GPU (in a private
# network: a user namespace, see launcher/isolation.py), SyncBatchNorm
# (PyTorch's, over nccl) and the SyncBN lesson script on every GPU, then the notebooks, and
# writes what it saw (GPUs, driver, versions, each figure, pass/fail per step) to
# docs/gpu-results.md. Exit status 0 when every step passed, 1 when one failed, 2 when this
# machine has no usable GPU (one sentence, nothing written). Notebooks: NOTEBOOKS="02 04"
# runs a subset; each gets NB_TIMEOUT seconds (default 240).
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python}
shipped() { "$PY" -c "import sys; from ddp_lesson.rank.bundled import script; print(script(sys.argv[1]))" "$1"; }  # a script's path

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "gpu_check: this machine has no NVIDIA GPU (nvidia-smi lists none), so there is nothing to check; nothing was written." >&2
  exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: nvidia-smi lists GPUs but this torch cannot use them (torch.cuda.is_available() is False: a CPU-only build or a driver mismatch); nothing was written." >&2
  exit 2
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
REPORT="$WORK/report.md"
FAILED=0
IDS=$("$PY" -c "from ddp_lesson import devices; print(','.join(str(g.index) for g in devices.list_gpus()))")
FIRST=${IDS%%,*}
NGPU=$(echo "$IDS" | tr ',' '\n' | grep -c .)

say() { printf '%s\n' "$*" >>"$REPORT"; }

# step NAME TIMEOUT CMD...: runs CMD, records pass/fail and seconds; its output goes to $WORK/NAME.log
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  echo "gpu_check: $name ..." >&2
  timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  local s=$((SECONDS - t0))
  if [ $rc -eq 0 ]; then
    say "| $name | pass | $s s |"
  else
    FAILED=1
    say "| $name | **FAIL** (exit $rc$([ $rc -eq 124 ] && echo ', timed out')) | $s s |"
    echo "gpu_check: $name failed (exit $rc); last lines:" >&2
    tail -n 15 "$WORK/$name.log" >&2
  fi
  return $rc
}

# figures RUN_DIR: the figures one run left behind, as markdown list items
figures() {
  "$PY" - "$1" <<'EOF' >>"$REPORT" 2>&1 || true
import json, sys
from pathlib import Path
from ddp_lesson.launcher import runs
d = Path(sys.argv[1])
if not (d / "config.json").exists():
    print(f"- (no run directory at {d})"); sys.exit()
rec = runs.load(d)
cfg = rec.config
print(f"- run: {cfg.get('nproc')} rank(s), backend {cfg.get('backend')}, devices {cfg.get('devices')}, "
      f"status {rec.status}, {(runs.read_json(d / 'result.json', {}) or {}).get('duration_s')} s")
for key in ("accuracy", "test_accuracy", "test_samples", "samples_per_s", "loss"):
    rows = [r for r in rec.rows if key in r]
    if rows:
        print(f"- last `{key}` (rank 0): {[r[key] for r in rows if r.get('rank') == 0][-1:]}")
for name in ("nccl.json", "syncbn.json"):
    if (d / name).exists():
        data = json.loads((d / name).read_text())
        first = data[0] if isinstance(data, list) else data
        for k, v in first.items():
            print(f"- `{name}` {k}: {v}")
EOF
}

{
  echo "# GPU check results"
  echo
  echo "Written by \`bash tools/gpu_check.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')."
  echo
  echo "## Machine"
  echo
  echo '```'
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1
  "$PY" -c "import torch, platform; print(f'python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {\".\".join(map(str, torch.cuda.nccl.version()))}, {torch.cuda.device_count()} visible GPU(s), CPU cores {__import__(\"os\").cpu_count()}')" 2>&1
  echo "GPUs used: $IDS"
  echo '```'
  echo
  echo "## Steps"
  echo
  echo "| step | result | time |"
  echo "|---|---|---|"
} >"$REPORT"

step doctor 180 "$PY" -m ddp_lesson doctor
step demo 300 "$PY" -m ddp_lesson demo --gpus "$FIRST" --epochs 1 --run-dir "$WORK/demo"
step nccl_all_reduce 180 "$PY" -m ddp_lesson run "$(shipped nccl_check.py)" --gpus "$IDS" --run-dir "$WORK/nccl"
# that nccl run was in a private network (a user namespace: issue 42) unless the OS refuses one;
# NCCL there is untested elsewhere: if this step or nccl_all_reduce fails, compare with
# DDP_LESSON_SHARED_NETWORK=1 (no namespace) and report both
step nccl_in_private_network 30 "$PY" - "$WORK/nccl" <<'EOF'
import json, sys
from pathlib import Path
from ddp_lesson.launcher import isolation
d = Path(sys.argv[1])
iso = json.loads((d / "config.json").read_text())["isolation"]
status = json.loads((d / "result.json").read_text())["status"]
assert status == "ok", status
if not iso["private_network"]:
    assert not isolation.status().isolated, iso
    print(f"this OS refuses private networks ({iso['why']}): NCCL in a user namespace NOT checked here")
else:
    print("nccl all_reduce ran in a private network (a user and network namespace with only loopback)")
EOF
step syncbn_stats 180 "$PY" -m ddp_lesson run "$(shipped syncbn_stats.py)" --gpus "$IDS" --run-dir "$WORK/syncbn" -- --batch-size 4
# PyTorch's SyncBatchNorm (not the CPU stand-in) must have run, and matched BN over the whole batch
step syncbn_is_pytorchs 30 "$PY" - "$WORK/syncbn/syncbn.json" <<'EOF'
import json, sys
ranks = json.load(open(sys.argv[1]))
for r in ranks:
    assert r["sync_class"] == "torch.nn.modules.batchnorm.SyncBatchNorm", r["sync_class"]
    assert r["backend"] == "nccl", r["backend"]
    assert r["sync_mean_matches_big_batch"] and r["sync_var_matches_big_batch"], r
    assert r["sync_output_matches_big_batch"] and r["sync_input_grad_matches_big_batch"], r
    assert r["running_var_unbiased_global_n"], r
print("nn.SyncBatchNorm over nccl on", len(ranks), "rank(s): matches BatchNorm over the concatenated batch")
EOF
step ddp_syncbn_lesson 300 "$PY" -m ddp_lesson run "$(shipped ddp_syncbn.py)" --gpus "$IDS" --run-dir "$WORK/lesson" -- --epochs 1 --batch-size 8 --sync-bn
step test_samples_once 30 "$PY" - "$WORK/lesson" <<'EOF'
import sys
from ddp_lesson.rank import data
from ddp_lesson.launcher import runs
rows = [r for r in runs.load(sys.argv[1]).rows if "test_accuracy" in r]
n = len(data.shapes_split(train=False))
assert rows and all(r["test_samples"] == n for r in rows), (n, rows)
print(f"every test sample counted once: {n}")
EOF
# what the step-time fields cost on GPUs (CUDA events, a host sync on the last one per step)
step step_timer_overhead 300 "$PY" bench/panel_overhead.py --timing --steps 300 --nproc "$NGPU"

NB_LIST=${NOTEBOOKS:-}
for nb in notebooks/*.ipynb; do   # 00-11, the capstone included
  base=$(basename "$nb" .ipynb)
  if [ -n "$NB_LIST" ] && ! echo " $NB_LIST " | grep -q " ${base:0:2} "; then continue; fi
  step "notebook_$base" "${NB_TIMEOUT:-240}" "$PY" -m pytest --nbval-lax -q -p no:cacheprovider "$nb"
done

{
  echo
  echo "## Figures"
  echo
  echo "### demo (ddp_basic.py on GPU $FIRST)"
} >>"$REPORT"
figures "$WORK/demo"
say ""; say "### nccl all_reduce on GPUs $IDS ($NGPU rank(s))"
figures "$WORK/nccl"
say ""; say "### syncbn_stats (per-rank batch 4) on GPUs $IDS"
figures "$WORK/syncbn"
say ""; say "### ddp_syncbn.py --sync-bn on GPUs $IDS"
figures "$WORK/lesson"
say ""; say "### step-time fields (bench/panel_overhead.py --timing --steps 300) on $NGPU GPU(s)"
say '```'; tail -n 6 "$WORK/step_timer_overhead.log" >>"$REPORT" 2>&1; say '```'
say ""
say "Overall: $([ $FAILED -eq 0 ] && echo 'every step passed' || echo 'at least one step FAILED (see the table)')."

mkdir -p docs
cp "$REPORT" docs/gpu-results.md
echo "gpu_check: wrote docs/gpu-results.md ($([ $FAILED -eq 0 ] && echo 'all steps passed' || echo 'some steps FAILED'))" >&2
exit $FAILED
