"""What each rank of a warm launch runs: torchrun's `--run-path --start-method fork` runs
this file as `__main__` in a forked worker, with sys.argv = [this file, "--rank", SCRIPT,
ARGS...]; the guard then runs SCRIPT as `__main__` exactly as in a cold launch."""
from ddp_lesson.rank import guard

guard.main()
