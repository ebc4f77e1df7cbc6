"""Pictures of the course's mental models, each drawn from the lesson's own numbers (a real
sampler's indices, a run's logged rows, a model's parameters), never from a formula, so it
stays right at any world size. Every function returns a matplotlib.figure.Figure (not pyplot:
nothing piles up in pyplot's list); a notebook shows one with `ddp_lesson.notebook.lesson.show(fig)`.

lessons.py    model vs data parallel, DataParallel's steps, sampler shares, a DDP step's
              timeline, which accumulation steps all-reduce
processes.py  the process tree of a run; CUDA_VISIBLE_DEVICES renumbering
collectives.py  all_reduce before and after; layers to buckets; set_epoch orders
batches.py    per-rank vs global BatchNorm statistics; accumulation windows
shapes.py     the drawing pieces they share
"""
from .lessons import *          # noqa: F401,F403
from .processes import *        # noqa: F401,F403
from .collectives import *      # noqa: F401,F403
from .batches import *          # noqa: F401,F403
from .shapes import DEVICE_COLOURS  # noqa: F401
