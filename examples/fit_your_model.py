"""Train your own module, Dataset and loss with tandem's Python API, on 2 local workers.

The model has a skip connection and BatchNorm, the data is a plain map-style ``Dataset`` of
``(image, label)`` pairs (the scikit-learn digits, no download), and the loss is label-smoothed
cross-entropy. Run it as ``python examples/fit_your_model.py [--steps N] [--strategy S]``, or
as one job of several processes with ``torchrun --nproc-per-node 2 examples/fit_your_model.py``
(then each process is one worker, and ``--nproc`` is torchrun's).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import tandem


class Digits(Dataset):
    """The 8x8 digits: item ``i`` is ``(1x8x8 float image, int label)``."""

    def __init__(self, train: bool) -> None:
        from sklearn.datasets import load_digits

        raw = load_digits()
        images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(raw.target)
        cut = 1437
        self.images, self.labels = ((images[:cut], labels[:cut]) if train
                                    else (images[cut:], labels[cut:]))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class ResidualNet(nn.Module):
    """Convolution, BatchNorm, a residual block and a linear classifier."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
        self.head = nn.Linear(width * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = F.relu(x + self.block(x))
        return self.head(x.flatten(1))


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The batch's mean loss, as tandem expects from a loss function."""
    return F.cross_entropy(logits, labels, label_smoothing=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--strategy", default="dp", help="dp, ps, gossip, easgd or localsgd")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    options = {"servers": 1} if args.strategy == "ps" else {}
    nproc = args.nproc + (1 if args.strategy == "ps" else 0)
    torch.manual_seed(0)
    model = ResidualNet()
    result = tandem.fit(model, Digits(train=True), Digits(train=False),
                        loss=smoothed_cross_entropy, strategy=args.strategy, nproc=nproc,
                        steps=args.steps, batch_size=64, lr=0.05, **options)
    summary = result.summary
    if not summary:  # another rank of a torchrun job: rank 0 reports
        return
    print(f"{args.strategy}: test accuracy {summary['test_accuracy']:.3f} after "
          f"{summary['steps']} steps in {summary['wall_s']:.1f} s "
          f"(BatchNorm running mean now {model.stem[1].running_mean.abs().mean():.3f})")


if __name__ == "__main__":
    main()
