"""ddp_lesson: plumbing for a hands-on course on multi-GPU training in PyTorch.

The lessons live in notebooks/ and in the training scripts under scripts/; this package
only launches and supervises torchrun, reads runs back and draws them.
"""
__version__ = "0.1.0"


class BadInput(ValueError):
    """Input that is wrong before anything starts; its message is one plain sentence."""


def load_ipython_extension(ipython):
    """`%load_ext ddp_lesson`: the %ranks / %%ranks magics of a live world (see magics.py)."""
    from .magics import register
    register(ipython)
