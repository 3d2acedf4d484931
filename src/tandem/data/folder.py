"""``--data folder:PATH``: a directory of image files, one subfolder per class, read into memory.

The layout is the one torchvision's ``ImageFolder`` reads: ``PATH/<class>/<image>``, classes
sorted by name and numbered from 0. If ``PATH`` holds ``train/`` and ``test/`` folders of that
layout, they are the two splits; otherwise a seeded fraction (``test=0.2``) is held out.
Images become float tensors ``C x H x W`` in [0, 1]: one channel if every image is grayscale,
else three (RGB). All images must have one size unless ``size=S`` resizes them to ``S x S``.

Usage::

    bundle = load_folder("folder:/data/digits:test=0.2,size=8")
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tandem.data.bundle import DataBundle, Split, split_held_out
from tandem.data.info import DataInfo
from tandem.spec.data import FolderOptions, check_split, read_folder_spec
from tandem.errors import UsageError

EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif",
                        ".tiff", ".webp"})
"""Image files read (by extension, case-insensitive); other files are ignored."""


def parse_folder_spec(spec: str) -> tuple[Path, FolderOptions]:
    """The directory and options of ``folder:PATH[:key=value,...]``."""
    path, options = read_folder_spec(spec)
    return Path(path).expanduser(), options


def load_folder(spec: str) -> DataBundle:
    """Read the image folder of ``spec`` into a train and a test split."""
    root, options, classes, files = folder_splits(spec)
    (train_x, test_x), _ = _read_all([files["train"], files["test"]], options, spec)
    train = Split(inputs=train_x, targets=_labels(files["train"]))
    test = Split(inputs=test_x, targets=_labels(files["test"]))
    info = DataInfo(task="classify", input_shape=tuple(train.inputs.shape[1:]),
                    num_classes=len(classes))
    return DataBundle(name=f"folder:{root}", train=train, test=test, info=info)


def folder_splits(spec: str) -> tuple[Path, FolderOptions, list[str],
                                      dict[str, list[tuple[Path, int]]]]:
    """The directory, options, class names and each split's ``(image file, label)`` pairs of
    ``folder:PATH``: its ``train/`` and ``test/`` folders, or a seeded held-out fraction (the
    files are listed, not read; ``tandem pack`` packs the same splits). A folder that cannot be
    listed (no permission) is one line naming it."""
    try:
        return _folder_splits(spec)
    except OSError as exc:
        raise UsageError(f"--data {spec}: cannot list {exc.filename or 'its folders'} "
                         f"({exc.strerror or exc}); make it readable") from None


def _folder_splits(spec: str) -> tuple[Path, FolderOptions, list[str],
                                       dict[str, list[tuple[Path, int]]]]:
    root, options = parse_folder_spec(spec)
    if not root.is_dir():
        raise UsageError(f"--data {spec}: {root} is not a directory; give a folder with one "
                         f"subfolder of images per class")
    if (root / "train").is_dir() and (root / "test").is_dir():
        classes = _classes(root / "train", spec)
        return root, options, classes, {
            "train": _files(root / "train", classes, spec),
            "test": _files(root / "test", classes, spec, allow_empty_classes=True)}
    classes = _classes(root, spec)
    every = _files(root, classes, spec)
    try:
        check_split(len(every), options.test)
    except ValueError as exc:
        raise UsageError(f"--data {spec}: {len(every)} images, and {exc}") from None
    train, test = split_held_out(torch.arange(len(every)), _labels(every), options.test,
                                 options.split_seed)
    return root, options, classes, {"train": [every[int(i)] for i in train.inputs],
                                    "test": [every[int(i)] for i in test.inputs]}


def _classes(root: Path, spec: str) -> list[str]:
    classes = sorted(entry.name for entry in root.iterdir()
                     if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise UsageError(f"--data {spec}: {root} has no class subfolders; put each class's "
                         f"images in a folder of its own ({root}/<class>/<image>.png)")
    return classes


def _files(root: Path, classes: list[str], spec: str, *,
           allow_empty_classes: bool = False) -> list[tuple[Path, int]]:
    files: list[tuple[Path, int]] = []
    for label, name in enumerate(classes):
        folder = root / name
        if folder.is_dir():  # rglob skips a folder it cannot list: that says why
            with os.scandir(folder):
                pass
        found = sorted(path for path in folder.rglob("*") if path.suffix.lower() in EXTENSIONS
                       and path.is_file()) if folder.is_dir() else []
        if not found and not allow_empty_classes:
            raise UsageError(f"--data {spec}: class folder {folder} has no images (files ending "
                             f"in {', '.join(sorted(EXTENSIONS))}); add some or remove it")
        files += [(path, label) for path in found]
    if not files:
        raise UsageError(f"--data {spec}: no images under {root}; put image files in "
                         f"{root}/<class>/")
    return files


def _labels(files: list[tuple[Path, int]]) -> torch.Tensor:
    return torch.tensor([label for _, label in files], dtype=torch.int64)


def _read_all(groups: list[list[tuple[Path, int]]], options: FolderOptions,
              spec: str) -> tuple[list[torch.Tensor], int]:
    """Each group's images as one float tensor ``N x C x H x W``, with the channel count shared
    by all (1 if every image is grayscale, else 3)."""
    from PIL import Image, UnidentifiedImageError

    images: list[list[Image.Image]] = []
    for group in groups:
        opened = []
        for path, _ in group:
            try:
                with Image.open(path) as source:
                    source.load()
                    opened.append(source.copy())
            except (OSError, UnidentifiedImageError) as exc:
                raise UsageError(f"--data {spec}: cannot read image {path} ({exc}); remove or "
                                 f"replace it") from None
        images.append(opened)
    grayscale = all(image.mode in ("L", "1", "I", "I;16", "F") for group in images
                    for image in group)
    mode, channels = ("L", 1) if grayscale else ("RGB", 3)
    sizes = {image.size for group in images for image in group}
    if options.size == 0 and len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:4])
        raise UsageError(f"--data {spec}: the images have different sizes ({shown}); resize "
                         f"them all with folder:PATH:size=S, e.g. size=32")
    tensors = []
    for group_images in images:
        arrays = []
        for image in group_images:
            image = image.convert(mode)
            if options.size:
                image = image.resize((options.size, options.size))
            array = np.asarray(image, dtype=np.float32) / 255.0
            arrays.append(array[None] if channels == 1 else array.transpose(2, 0, 1))
        tensors.append(torch.from_numpy(np.stack(arrays)) if arrays else
                       torch.empty(0, channels, *(2 * [options.size or 1])))
    return tensors, channels
