"""Rank side: what runs inside torchrun's processes (the guard around the agent and every rank,
and what lesson scripts and a live world's ranks import). Standard library and torch only
(psutil for guard and procs), and only other rank-side modules: a rank never pays for the
kernel's supervision or the notebook's drawing. scripts/ holds the scripts the ranks run."""
