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
_HERE = os.path.dirname(os.path.abspath(__file__))


class BadInput(ValueError):
    """Input that is wrong before anything starts; its message is one plain sentence."""


def load_ipython_extension(ipython):
    """`%load_ext ddp_lesson`: the %ranks / %%ranks magics of a live world (see magics.py)."""
    from .notebook.magics import register
    register(ipython)


class _ShortNames:
    """An import finder: `ddp_lesson.launch` (and `ddp_lesson.diagrams.shapes`) is imported
    as `ddp_lesson.kernel.launch`, found by which world's folder holds it. The import system
    hands back what exec_module left in sys.modules under the short name, the real module
    itself: both names are one object, so a monkeypatch through either patches what runs."""

    def find_spec(self, name, path=None, target=None):
        if self.real(name):
            from importlib.machinery import ModuleSpec
            return ModuleSpec(name, self)
        return None

    @staticmethod
    def real(name):
        """The module's real name, or None where `name` is no short name."""
        if not name.startswith(__name__ + "."):
            return None
        parts = name.split(".")
        if parts[1] in WORLDS:
            return None
        for world in WORLDS:
            where = os.path.join(_HERE, world, parts[1])
            if os.path.isfile(where + ".py") or os.path.isfile(os.path.join(where, "__init__.py")):
                return ".".join([parts[0], world, *parts[1:]])
        return None

    def create_module(self, spec):
        return None   # a placeholder module, replaced in exec_module

    def exec_module(self, module):
        import importlib
        sys.modules[module.__name__] = importlib.import_module(self.real(module.__name__))


if not any(type(f).__name__ == "_ShortNames" for f in sys.meta_path):
    sys.meta_path.insert(0, _ShortNames())
