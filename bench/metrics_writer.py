"""Writes a metric row every 20 ms for a few seconds (for the latency benchmark)."""
import sys
import time

from ddp_lesson.rank import metrics

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
for step in range(n):
    metrics.log(step, loss=1.0 / (step + 1))
    time.sleep(0.02)
