"""Notebook 10's exercise: the fp16 step that trains too slowly (clipping before unscale_):
by how much (check_too_small_by) and the step fixed (check_train_step)."""


def _recording_scaler(init_scale=2.0 ** 16):
    """A GradScaler("cpu") that notes which of its four calls were made, in order."""
    import torch

    class Recording(torch.amp.GradScaler):
        def __init__(self):
            super().__init__("cpu", init_scale=init_scale)
            self.calls = []

        def scale(self, outputs):
            self.calls.append("scale")
            return super().scale(outputs)

        def unscale_(self, optimizer):
            self.calls.append("unscale_")
            return super().unscale_(optimizer)

        def step(self, optimizer, *args, **kwargs):
            self.calls.append("step")
            return super().step(optimizer, *args, **kwargs)

        def update(self, new_scale=None):
            self.calls.append("update")
            return super().update(new_scale)
    return Recording()


def _start():
    """The exercise's model (seed 0) and batch (8 samples, seed 23: enough for a gradient
    whose norm clipping changes; fp16 convolutions are slow on CPU)."""
    import torch

    from ...rank import data, models
    x, y = data.shapes(8, seed=23).tensors
    torch.manual_seed(0)
    return models.SmallCNN(norm=False), x, y


def _reference(model, x, y, max_norm):
    """The reference step on `model`: the true gradient (fp16 autocast, no scaler), clipped to
    max_norm, one SGD step (lr 0.1). Returns the gradient's norm before and after clipping."""
    import torch
    import torch.nn.functional as F
    with torch.autocast("cpu", dtype=torch.float16):
        F.cross_entropy(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    clipped = sum(p.grad.norm() ** 2 for p in model.parameters()) ** .5
    return norm.item(), clipped.item()


def stepped_norm(fn, max_norm=0.1, init_scale=2.0 ** 16):
    """10: the norm of the gradient the optimizer steps with, in one step of fn (the
    checker's start and batch), with a GradScaler whose scale starts at init_scale."""
    import torch
    model, x, y = _start()
    opt, seen = torch.optim.SGD(model.parameters(), lr=0.1), []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(
        torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()))
    fn(model, opt, _recording_scaler(init_scale), x, y, max_norm)
    assert seen, "the step never called the optimizer's step()"
    return seen[0]


def check_train_step(fn, max_norm=0.1):
    """10: one step of fn(model, opt, scaler, x, y, max_norm) (fp16 autocast on CPU, a
    GradScaler, clipping) against the reference step: the true gradient, clipped to
    max_norm, one SGD step. The step must use the scaler it is given (scale, unscale_,
    step, update, once each, in that order): without it fp16 gradients can underflow, even
    where this batch's do not. Raises AssertionError with one sentence saying what is wrong."""
    import copy

    import torch
    model, x, y = _start()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _recording_scaler()
    fn(model, opt, scaler, x, y, max_norm)
    wanted = ["scale", "unscale_", "step", "update"]
    assert scaler.calls == wanted, (
        f"the step made the GradScaler calls {scaler.calls}, not {wanted}: fp16 needs the scaler "
        "(scale the loss before backward, unscale_ before clipping, scaler.step, scaler.update)")
    norm, clipped = _reference(reference, x, y, max_norm)
    assert norm > max_norm, "the test needs a gradient that clipping changes"
    moved = sum((p - q).norm() ** 2 for p, q in zip(model.parameters(), reference.parameters())) ** .5
    step = 0.1 * clipped
    assert moved < 1e-2 * step, f"the step differs from the reference by {moved / step:.0%} of its size"
    return True


def check_too_small_by(too_small_by, slow_step, max_norm=0.1, scales=(2.0 ** 16, 2.0 ** 10)):
    """10: too_small_by(S) says how many times smaller than the reference step's gradient the
    gradient slow_step steps with is, when the GradScaler's scale is S. Compared, within 1%,
    with the ratio measured at each scale in `scales` (two, so a number read off one run
    does not pass). Raises AssertionError with one sentence saying what is wrong."""
    model, x, y = _start()
    _, clipped = _reference(model, x, y, max_norm)
    for S in scales:
        measured = clipped / stepped_norm(slow_step, max_norm, init_scale=S)
        said = too_small_by(S)
        assert said is not None and abs(said - measured) <= 0.01 * measured, (
            f"with the scale S = {S:,.0f} the step was {measured:,.1f}x too small; too_small_by({S:,.0f}) "
            f"returns {said}")
    return True
