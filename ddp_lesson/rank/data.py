"""Data that needs no download: `shapes`, ten classes of noisy drawn shapes (3x16x16),
generated from a seed in milliseconds and learnable by a small CNN in a few epochs.
CIFAR-10 through torchvision is the real-dataset option (download needs internet)."""
import os

import torch
from torch.utils.data import TensorDataset

CLASSES = ("square", "frame", "disc", "ring", "hbar", "vbar", "plus", "cross", "diagonal", "triangle")
SIZE = 16


def _masks(label, dx, dy, r):
    ax, ay = dx.abs(), dy.abs()
    inside = (ax <= r) & (ay <= r)
    dist = (dx ** 2 + dy ** 2).sqrt()
    shapes = [
        inside,
        inside & (torch.maximum(ax, ay) >= r - 1),
        dist <= r,
        (dist <= r) & (dist >= r - 1.3),
        (ay <= 1) & (ax <= r),
        (ax <= 1) & (ay <= r),
        ((ay <= 1) & (ax <= r)) | ((ax <= 1) & (ay <= r)),
        inside & (((dx - dy).abs() <= 1) | ((dx + dy).abs() <= 1)),
        inside & ((dx - dy).abs() <= 1),
        (dy <= r) & (dy >= -r) & (ax <= (dy + r) / 2),
    ]
    stacked = torch.stack(shapes, 1)  # (n, 10, H, W)
    return stacked[torch.arange(len(label)), label]


def shapes(n=4096, seed=0, noise=0.35):
    """A TensorDataset of n images (float32, 3x16x16, roughly zero-mean) and labels 0-9."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, len(CLASSES), (n,), generator=g)
    centre = torch.randint(5, SIZE - 5, (n, 2), generator=g).float()
    r = torch.randint(3, 6, (n, 1, 1), generator=g).float()
    grid = torch.arange(SIZE).float()
    dx = grid.view(1, 1, SIZE) - centre[:, 0].view(n, 1, 1)
    dy = grid.view(1, SIZE, 1) - centre[:, 1].view(n, 1, 1)
    mask = _masks(label, dx.expand(n, SIZE, SIZE), dy.expand(n, SIZE, SIZE), r).float()
    colour = torch.rand(n, 3, 1, 1, generator=g) * 0.8 + 0.4
    images = mask.unsqueeze(1) * colour + noise * torch.randn(n, 3, SIZE, SIZE, generator=g)
    return TensorDataset(images - 0.2, label)


def shapes_split(train=True, n_train=4096, n_test=1024):
    """Fixed train/test splits (different seeds, so no test image is a training image)."""
    return shapes(n_train, seed=0) if train else shapes(n_test, seed=1)


def cifar10(root, train=True, download=False):
    """CIFAR-10 from `root` in torchvision's on-disk format (cifar-10-batches-py/)."""
    import torchvision
    from torchvision import transforms

    tf = transforms.Compose([transforms.ToTensor(),
                             transforms.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))])
    folder = os.path.join(root, "cifar-10-batches-py")
    if download and not os.path.isdir(folder):
        return torchvision.datasets.CIFAR10(root, train=train, download=True, transform=tf)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"CIFAR-10 is not in {root}; pass download=True (needs internet) "
                                f"or copy cifar-10-batches-py/ there.")
    # torchvision checks each file's md5 before reading: a truncated copy fails here
    return torchvision.datasets.CIFAR10(root, train=train, download=False, transform=tf)


def get(name="shapes", train=True, root="data", download=False):
    if name == "shapes":
        return shapes_split(train)
    if name == "cifar10":
        return cifar10(root, train=train, download=download)
    raise ValueError(f"unknown dataset {name!r}: use 'shapes' or 'cifar10'")


IMAGE_SIZE = {"shapes": SIZE, "cifar10": 32}  # height = width, for models.SmallCNN(image_size=...)
