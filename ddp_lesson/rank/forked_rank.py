"""Kept for old names only: warm ranks were once torchrun's `--run-path --start-method fork`
workers running this file. They are now forked by their own warm process (warm_ranks)."""
from ddp_lesson.rank import guard

guard.main()
