"""Notebook 03b's exercise: the global batch and the learning rate by the linear scaling rule."""


def check_scaled(fn):
    """03b: fn(per_device_batch, world_size, base_batch, base_lr) -> (global batch, lr by the
    linear scaling rule)."""
    cases = [((32, 1, 32, 0.1), 32, 0.1), ((32, 8, 256, 0.1), 256, 0.1), ((64, 4, 32, 0.05), 256, 0.4),
             ((48, 1, 32, 0.1), 48, 0.15), ((16, 2, 64, 0.1), 32, 0.05),   # k = 1.5, k = 0.5
             ((48, 8, 32, 0.1), 384, 1.2)]          # the notebook's own example (8 x 48), not one of Goyal et al.'s
    for args, want_batch, want_lr in cases:
        global_batch, lr = fn(*args)
        assert global_batch == want_batch, f"scaled{args}: {global_batch} is not this job's global batch"
        assert abs(lr - want_lr) < 1e-12, f"scaled{args}: with lr {lr:g} an epoch does not go as far as the recipe's"
    return True
