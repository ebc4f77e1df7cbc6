"""Small models the lessons train: fast on CPU, with BatchNorm where a lesson needs it."""
from torch import nn


class SmallCNN(nn.Module):
    """conv-BN-ReLU-pool x2, then a linear classifier. norm=False drops BatchNorm
    (gradient accumulation is exact only without it)."""

    def __init__(self, num_classes=10, in_channels=3, width=16, norm=True, image_size=16):
        super().__init__()

        def block(cin, cout):
            layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=not norm)]
            if norm:
                layers.append(nn.BatchNorm2d(cout))
            return layers + [nn.ReLU(), nn.MaxPool2d(2)]

        self.features = nn.Sequential(*block(in_channels, width), *block(width, 2 * width))
        self.classifier = nn.Linear(2 * width * (image_size // 4) ** 2, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))
