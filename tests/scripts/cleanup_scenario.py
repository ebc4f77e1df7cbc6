"""Runs inside its own PID namespace (see test_cli.py): makes a leftover run and a
bystander, runs `python -m ddp_lesson cleanup --dry-run` then `cleanup`, and prints one
JSON line with what happened. Because the namespace only holds what this script started,
`cleanup` cannot reach anybody else's runs on a shared machine.

The leftover run is a torchrun started in a new session with DDP_LESSON_RUN_DIR set,
whose starting shell exits at once (with the run's token in its environment and config.json): a run whose launcher died without the guard ending
it (an older version, a non-Linux machine, a `kill -9` of a guard-less launcher)."""
import json
import os
import subprocess
import sys
import time

import psutil

run_dir, sleeper, out_file = sys.argv[1:4]
os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump({"script": sleeper, "nproc": 2, "token": "tok"}, f)

env = dict(os.environ, DDP_LESSON_RUN_DIR=run_dir, DDP_LESSON_RUN_TOKEN="tok")
subprocess.run(["sh", "-c", 'setsid "$@" >"$OUT" 2>&1 </dev/null &', "sh", sys.executable, "-m",
                "torch.distributed.run", "--standalone", "--nproc-per-node", "2", sleeper],
               env=dict(env, OUT=out_file), check=True)
bystander = subprocess.Popen(["sleep", "300"])  # no DDP_LESSON_RUN_DIR: must survive
# carries the run directory but not the run's token: not a process of ours, must survive
impostor = subprocess.Popen(["sleep", "300"], env=dict(os.environ, DDP_LESSON_RUN_DIR=run_dir))


def run_procs():
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("DDP_LESSON_RUN_DIR") == run_dir and env.get("DDP_LESSON_RUN_TOKEN") == "tok" \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


report = {}
end = time.monotonic() + 60
while time.monotonic() < end:
    text = open(out_file, errors="replace").read() if os.path.exists(out_file) else ""
    if "ready rank 0" in text and "ready rank 1" in text:
        break
    time.sleep(0.1)
report["leftover"] = run_procs()
clean_env = {k: v for k, v in os.environ.items() if k != "DDP_LESSON_RUN_DIR"}
dry = subprocess.run([sys.executable, "-m", "ddp_lesson", "cleanup", "--dry-run"],
                     capture_output=True, text=True, env=clean_env)
report["dry_run"] = {"rc": dry.returncode, "stdout": dry.stdout, "stderr": dry.stderr,
                     "alive_after": run_procs()}
t0 = time.monotonic()
real = subprocess.run([sys.executable, "-m", "ddp_lesson", "cleanup"],
                      capture_output=True, text=True, env=clean_env)
report["cleanup"] = {"rc": real.returncode, "stdout": real.stdout, "stderr": real.stderr,
                     "seconds": round(time.monotonic() - t0, 2)}
while run_procs() and time.monotonic() - t0 < report["cleanup"]["seconds"] + 10:
    time.sleep(0.1)
report["alive_after"] = run_procs()
report["gone_after_s"] = round(time.monotonic() - t0, 2)
report["bystander_alive"] = bystander.poll() is None
report["impostor_alive"] = impostor.poll() is None
for p in (bystander, impostor):
    p.kill()
    p.wait()
print(json.dumps(report), flush=True)
