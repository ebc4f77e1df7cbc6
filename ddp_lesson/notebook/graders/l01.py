"""Notebook 01's exercise: the chunk sizes DataParallel's scatter makes, by a rule of the
learner's own (a direct call of torch's chunk or split is refused)."""


_SPLITTERS = ("chunk", "tensor_split", "split", "unsafe_chunk", "unsafe_split", "split_with_sizes")


def _torch_splitter(fn):
    """The name of the torch chunk or split builtin `fn` is, else None: a function of the torch
    modules (torch.chunk, torch._VF.chunk, torch.ops.aten.chunk) or a Tensor method."""
    import torch
    name = getattr(fn, "__name__", "")
    owner = getattr(fn, "__self__", None)
    if name in _SPLITTERS and ((getattr(fn, "__module__", None) or "").startswith("torch")
                               or isinstance(owner, torch.Tensor)):
        return name
    return None


def check_dp_chunk_sizes(fn):
    """01: fn(batch, n_devices) is the list of chunk sizes DataParallel's scatter makes, found
    by a rule of the learner's own. While fn runs, a profile hook watches each call that
    Python code makes to a C function, in this thread (sys.setprofile) and in threads fn
    starts (threading.setprofile): a direct call of torch's chunk or split fails it, and so
    does a function that changes the hook. This is a guard against the obvious shortcut,
    not a sandbox: a C function called from C (map, functools.partial, operator.methodcaller)
    makes no event to watch."""
    import sys
    import threading

    import torch
    wants = {(batch, n): [len(c) for c in torch.empty(batch).chunk(n)]
             for batch in range(1, 40) for n in range(1, 9)}
    seen = []

    def watch(frame, event, arg):
        name = _torch_splitter(arg) if event == "c_call" and not seen else None
        if name:
            seen.append(name)

    before, before_threads = sys.getprofile(), threading.getprofile()
    for (batch, n), want in wants.items():
        threading.setprofile(watch)
        sys.setprofile(watch)
        try:
            got = fn(batch, n)
            changed = sys.getprofile() is not watch or threading.getprofile() is not watch
        finally:
            sys.setprofile(before)
            threading.setprofile(before_threads)
        assert not changed, "leave the profile hook alone: your function changed sys.setprofile"
        assert not seen, f"write the rule yourself: your function called torch's {seen[0]}"
        assert got is not None and list(got) == want, \
            f"batch {batch} on {n} devices: DP makes {want}, you said {got}"
    return True
