"""PID 1 of a test's PID namespace: runs the command given, reaps every orphan (as init
does), and exits with the command's status."""
import os
import subprocess
import sys

child = subprocess.Popen(sys.argv[1:])
while True:
    pid, status = os.wait()
    if pid == child.pid:
        sys.exit(os.waitstatus_to_exitcode(status))
