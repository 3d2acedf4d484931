"""VGG-16 as an ``nn.Sequential`` of blocks (13 conv blocks, 5 pools, 3 linear), width scalable."""

from __future__ import annotations


from torch import nn

from tandem.data.info import DataInfo
from tandem.spec.model import VGGOptions

VGG16_LAYOUT: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)


def build_vgg(options: VGGOptions, info: DataInfo) -> nn.Sequential:
    """Conv blocks (a pool joins the block before it), then three linear blocks.

    A pool that would shrink the image below one pixel is left out, so small inputs such as the
    8x8 digits keep all 16 weight layers.
    """
    channels, size = info.input_shape[0], info.input_shape[-1]
    blocks: list[nn.Sequential] = []
    for entry in VGG16_LAYOUT:
        if entry == "M":
            if size >= 2:
                blocks[-1].append(nn.MaxPool2d(2))
                size //= 2
            continue
        out = max(1, int(round(int(entry) * options.width)))
        layers: list[nn.Module] = [nn.Conv2d(channels, out, 3, padding=1)]
        layers += [nn.BatchNorm2d(out)] if options.bn else []
        blocks.append(nn.Sequential(*layers, nn.ReLU()))
        channels = out
    hidden = options.hidden or max(1, int(round(4096 * options.width)))
    blocks.append(nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, hidden), nn.ReLU()))
    blocks.append(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()))
    return nn.Sequential(*blocks, nn.Linear(hidden, info.num_classes))
