"""Notebook 06's exercise: the alpha-beta model's speed-up of n ranks."""


def check_predict(fn):
    """06: fn(n, compute_s, grad_bytes, alpha, beta) is the alpha-beta model's speed-up of n
    ranks (a ring all-reduce of the gradients after the compute), within 1e-6."""
    cases = [  # (n, compute_s, grad_bytes, alpha, beta) -> expected
        ((1, 0.1, 100e6, 1e-5, 10e9), 1.0),
        ((2, 0.1, 100e6, 1e-5, 10e9), 2 * 0.1 / (0.1 + 2 * 1e-5 + 1.0 * 100e6 / 10e9)),
        ((8, 0.1, 100e6, 1e-5, 10e9), 8 * 0.1 / (0.1 + 14 * 1e-5 + 1.75 * 100e6 / 10e9)),
        ((8, 0.002, 1e6, 5e-4, 0.5e9), 8 * 0.002 / (0.002 + 14 * 5e-4 + 1.75 * 1e6 / 0.5e9)),
    ]
    for args, want in cases:
        got = fn(*args)
        assert abs(got - want) <= 1e-6 * want, f"predict{args}: the model gives {want:.4g}, you said {got}"
    return True
