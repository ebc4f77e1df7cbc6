"""Notebook 00's exercise: which cuda:N a physical GPU is under CUDA_VISIBLE_DEVICES."""


def check_cuda_index(fn):
    """00: fn(physical, cuda_visible_devices) is the cuda:N index of a physical GPU under that
    CUDA_VISIBLE_DEVICES, as torch reads it, or raises ValueError where the GPU is hidden."""
    cases = [(2, "2,3", 0), (3, "2,3", 1), (3, "3,2", 0), (0, "0", 0), (6, "1, 4,6", 2), (4, "1, 4,6", 1),
             (0, "7,0", 1), (0, "0,9,1", 0), (2, "2gpu,3", 0), (3, "2gpu,3", 1), (0, "0,x,0", 0),
             (0, "+2,0", 1), (1, "-0,1", 1)]     # "+2" is 2, "-0" is 0
    for physical, visible, want in cases:
        try:
            got = fn(physical, visible)
        except ValueError as e:
            got = f"ValueError({e})"
        assert got == want, f"GPU {physical} with CUDA_VISIBLE_DEVICES={visible!r} is cuda:{want}, you said {got}"
    # "0,9,0": torch looks for a repeat before it cuts the list at 9, a GPU the server lacks
    # "1,,2" and "x,1": an empty entry or a word stops the list, it is not skipped
    # "0,8,1": GPU 8 is the first the server lacks; "0,-0", "2gpu,2": a repeat is of the number
    for physical, visible in [(0, "2,3"), (1, ""), (1, "0,9,1"), (1, "0,-1,1"), (1, "1,1"), (2, "2,3,2"),
                              (0, "0,9,0"), (2, "1,,2"), (1, "x,1"), (1, "0,8,1"), (0, "0,-0"),
                              (2, "2gpu,2")]:
        try:
            fn(physical, visible)
        except ValueError:
            continue
        raise AssertionError(f"GPU {physical} is not visible with CUDA_VISIBLE_DEVICES={visible!r}: expected ValueError")
    return True
