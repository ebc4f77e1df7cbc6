"""Notebook 02's exercise: each sample's weight in DataParallel's mean of per-device means,
predicted, not asked of autograd."""


_AUTOGRAD_NAMES = {"backward", "autograd", "requires_grad", "requires_grad_", "enable_grad",
                   "set_grad_enabled", "vjp", "jacrev", "jacfwd", "functorch", "run_backward"}

_AUTOGRAD_DIRS = ("torch/autograd/", "torch/_functorch/", "torch/func/")


def _autograd_names(fn):
    """The autograd names fn's source uses as names: comments and strings do not count."""
    import inspect
    import io
    import textwrap
    import tokenize
    try:
        text = textwrap.dedent(inspect.getsource(fn))
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError, SyntaxError):
        return []      # no source to read (a builtin, a lambda mid-line): the run-time watch still guards
    names = [t.string for t in tokens if t.type == tokenize.NAME]
    found = [n for n in names if n in _AUTOGRAD_NAMES]
    found += ["torch.func" for a, b, c in zip(names, names[1:], names[2:]) if (a, b) == ("torch", "func")]
    found += ["torch.func" for a, b in zip(tokens, tokens[1:]) if (a.string, b.string) == (".", "func")]
    return found


def _asks_autograd(fn, *args):
    """fn(*args) with autograd off, and the first call fn made into torch's autograd (torch.autograd,
    torch.func, torch._functorch: backward, grad, vjp, set_grad_enabled ...), else None. A profile
    hook watches each Python call in this thread and in threads fn starts. A guard against the
    obvious routes, not a sandbox."""
    import sys
    import threading

    import torch
    seen = []

    def watch(frame, event, arg):
        if seen:
            return
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            if any(d in path for d in _AUTOGRAD_DIRS):
                seen.append(frame.f_code.co_name)
        elif event == "c_call" and getattr(arg, "__name__", "") == "run_backward":
            seen.append("run_backward")

    before, before_threads = sys.getprofile(), threading.getprofile()
    with torch.no_grad():    # autograd off while fn runs
        threading.setprofile(watch)
        sys.setprofile(watch)
        try:
            got = fn(*args)
            changed = sys.getprofile() is not watch or threading.getprofile() is not watch
        finally:
            sys.setprofile(before)
            threading.setprofile(before_threads)
    assert not changed, "leave the profile hook alone: your function changed sys.setprofile"
    return got, (seen[0] if seen else None)


def check_weights(fn):
    """02: fn(batch, n_devices) is each sample's weight in DataParallel's mean of per-device
    means, as autograd finds it. The answer must predict them: asking autograd is refused, by
    the names fn's source uses and by a watch on its calls into torch's autograd."""
    import torch
    for word in _autograd_names(fn):
        raise AssertionError(f"your function uses {word}: the exercise is to predict each weight "
                             f"from DP's split, not to let autograd compute it")
    torch.manual_seed(0)
    for batch in range(1, 25):
        for n in range(1, 9):
            losses = torch.rand(batch, dtype=torch.float64, requires_grad=True)
            torch.stack([c.mean() for c in losses.chunk(n)]).mean().backward()   # DP's split, mean of means
            want = [round(w, 4) for w in losses.grad.tolist()]
            try:
                got, asked = _asks_autograd(fn, batch, n)
            except RuntimeError as e:
                raise AssertionError(f"batch {batch} on {n} devices: your function failed with autograd off "
                                     f"({str(e).splitlines()[0]}): predict the weights, do not ask autograd") from None
            assert not asked, (f"your function called torch's autograd ({asked}): the exercise is to predict "
                               f"each weight from DP's split, not to let autograd compute it")
            assert got is not None and len(got) == batch, \
                f"batch {batch} on {n} devices: want one weight per sample, {want}; you said {got}"
            assert torch.allclose(torch.as_tensor(got, dtype=torch.float64), losses.grad), \
                f"batch {batch} on {n} devices: the weights are {want}; you said {got}"
    return True
