"""A rank with a family, for the no-leftovers tests (no torch: starts fast): a child in its
own session, a daemon that left the tree at once (its starting shell exited), and with
--ignore-term a rank that ignores SIGTERM, so only SIGKILL ends it."""
import signal
import subprocess
import sys
import time

if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen(["sleep", "300"])                                   # same session
subprocess.Popen(["sleep", "300"], start_new_session=True)           # own session
subprocess.run(["sh", "-c", "setsid sleep 300 </dev/null >/dev/null 2>&1 &"])  # left the tree
print("ready", flush=True)
while True:
    time.sleep(1)
