"""ddp_lesson: plumbing for a hands-on course on multi-GPU training in PyTorch.

The lessons live in notebooks/ and in the training scripts under rank/scripts/; this package
only launches and supervises torchrun, reads runs back and draws them. It is three folders,
one per world (docs/architecture.md): rank/ runs inside torchrun's processes, kernel/ starts,
supervises and reads back runs, notebook/ draws and teaches. A module's short name imports
too (`from ddp_lesson import launch`, `from ddp_lesson.widgets import RunPanel`): it is the
same module object as its folder's name (ddp_lesson.kernel.launch).
"""
import os
import sys

__version__ = "0.1.0"
WORLDS = ("rank", "kernel", "notebook")   # one folder each; a module's world is its folder


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


# Each module's short name and its world: `ddp_lesson.launch` is `ddp_lesson.kernel.launch`. One
# list, written out so that an import looks nothing up on disk; tests/test_worlds.py checks that it
# equals the folders' modules.
_SHORT = {
    **dict.fromkeys(("agent", "bundled", "chain", "costmodel", "data", "guard", "knobs", "metrics",
                     "models", "netns", "procs", "rundir", "scratch_check", "syncbn", "world_messages", "world_rank"),
                    "rank"),
    **dict.fromkeys(("checks", "devices", "doctor", "failures", "interrupts", "isolation", "launch", "monitor",
                     "multinode", "runs", "scaling", "slurm", "spec", "stacks", "warm", "world"), "kernel"),
    **dict.fromkeys(("capstone", "diagrams", "exercises", "lesson", "magics", "plots", "simulate",
                     "syncbn_compare", "widgets"), "notebook"),
}


class _ShortNames:
    """An import finder and loader: `ddp_lesson.launch` (and `ddp_lesson.diagrams.shapes`) is
    imported as `ddp_lesson.kernel.launch`. The import system hands back what exec_module left
    in sys.modules under the short name, the real module itself: both names are one object, so
    a monkeypatch through either patches what runs. The spec carries the real file (origin), and
    get_code hands over the real module's code, so `python -m ddp_lesson.guard` (the command an
    older run directory's config.json records) runs ddp_lesson/rank/guard.py as __main__."""

    def find_spec(self, name, path=None, target=None):
        real = self.real(name)
        if real is None:
            return None
        from importlib.machinery import ModuleSpec
        from importlib.util import find_spec
        found = find_spec(real)
        if found is None:
            return None
        spec = ModuleSpec(name, self, origin=found.origin, is_package=found.submodule_search_locations is not None)
        spec.has_location = found.has_location
        if found.submodule_search_locations is not None:
            spec.submodule_search_locations = list(found.submodule_search_locations)
        return spec

    @staticmethod
    def real(name):
        """The module's real name, or None where `name` is no short name."""
        parts = name.split(".")
        if parts[0] != __name__ or len(parts) < 2 or parts[1] not in _SHORT:
            return None
        return ".".join([parts[0], _SHORT[parts[1]], *parts[1:]])

    def create_module(self, spec):
        return None   # a placeholder module, replaced in exec_module

    def exec_module(self, module):
        import importlib
        sys.modules[module.__name__] = importlib.import_module(self.real(module.__name__))

    def get_code(self, name):
        """What runpy runs for `python -m ddp_lesson.<short name>`: the real module's code."""
        from importlib.util import find_spec
        real = self.real(name)
        return find_spec(real).loader.get_code(real)

    def is_package(self, name):
        from importlib.util import find_spec
        return find_spec(self.real(name)).submodule_search_locations is not None


# First in sys.meta_path, ahead of the file-system finder: a checkout upgraded by `git pull` from
# the flat layout can keep a folder such as ddp_lesson/diagrams/ that holds only __pycache__, which
# the file-system finder would import as an empty namespace package in place of the real module.
if not any(type(f).__name__ == "_ShortNames" for f in sys.meta_path):
    sys.meta_path.insert(0, _ShortNames())
