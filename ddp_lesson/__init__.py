"""ddp_lesson: plumbing for a hands-on course on multi-GPU training in PyTorch.

The lessons live in notebooks/ and in the training scripts under rank/scripts/; this package
only launches and supervises torchrun, reads runs back and draws them. It is three folders,
one per world (docs/architecture.md): rank/ runs inside torchrun's processes, launcher/ starts,
supervises and reads back runs, notebook/ draws and teaches. Every module has one name, its
path: `from ddp_lesson.launcher import launch`, `from ddp_lesson.notebook.widgets import RunPanel`.
"""
import os
import sys

__version__ = "0.1.0"
WORLDS = ("rank", "launcher", "notebook")   # one folder each; a module's world is its folder


class BadInput(ValueError):
    """Input that is wrong before anything starts; its message is one plain sentence."""


WORK_ENV = "DDP_LESSON_WORK"   # where a notebook kernel works when the course folder is read-only


def learner_folder(cwd=None, env=None):
    """A notebook kernel whose folder this user cannot write to (a shared, read-only course
    folder) moves to a folder of the learner's own: $DDP_LESSON_WORK, else
    ~/ddp-lesson-work/<the folder's name>. Every notebook writes work/ and runs/ relative to the
    kernel's folder; its links to ../docs resolve against the notebook file, so they still work.
    Returns the folder moved to, or None."""
    cwd = os.path.abspath(cwd or os.getcwd())
    env = os.environ if env is None else env
    if os.access(cwd, os.W_OK):
        return None
    target = os.path.abspath(os.path.expanduser(env.get(WORK_ENV) or
                                                os.path.join("~", "ddp-lesson-work", os.path.basename(cwd))))
    try:
        os.makedirs(target, mode=0o700, exist_ok=True)   # 0700 whatever the umask: the learner's own
        os.chmod(target, 0o700)
        os.chdir(target)
    except OSError as e:
        print(f"ddp_lesson: {cwd} is read-only for you and {target} could not be made ({e}); "
              f"set {WORK_ENV} to a folder you can write to.", file=sys.stderr)
        return None
    print(f"ddp_lesson: the course folder {cwd} is read-only for you, so this notebook works in {target} "
          f"(your edited scripts in work/, your runs in runs/).")
    return target


# only in a notebook's kernel (never in a rank, the warm process or the command line), before
# the notebook's first %%writefile or launch: each notebook's first code cell imports ddp_lesson
if "ipykernel" in sys.modules:
    learner_folder()


def load_ipython_extension(ipython):
    """`%load_ext ddp_lesson`: the %ranks / %%ranks magics of a live world (see magics.py)."""
    from .notebook.magics import register
    register(ipython)
