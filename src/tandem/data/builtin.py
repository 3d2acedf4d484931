"""The built-in datasets by name: the real 8x8 digits and synthetic images and tokens, built
from their ``name:key=value,...`` spec."""

from __future__ import annotations

from typing import Any, Callable

from tandem.data.bundle import DataBundle
from tandem.data.digits import load_digits
from tandem.data.synthetic import make_images, make_tokens
from tandem.spec.data import DATASET_OPTIONS, read_dataset_spec

MAKERS: dict[str, Callable[[Any], DataBundle]] = {
    "digits": load_digits, "images": make_images, "tokens": make_tokens,
}

DATASETS: dict[str, tuple[type, Callable[[Any], DataBundle]]] = {
    name: (options, MAKERS[name]) for name, options in DATASET_OPTIONS.items()}
"""Name -> (options dataclass, maker): the names and options of :mod:`tandem.spec.data` (which
reads a spec without torch)."""


def build_dataset(spec: str) -> DataBundle:
    """Build the dataset named by ``spec`` (``name`` or ``name:key=value,...``)."""
    name, options = read_dataset_spec(spec)
    return DATASETS[name][1](options)


def dataset_bytes(spec: str) -> int | None:
    """About the most memory building dataset ``spec`` takes, from its options alone (their
    ``memory_bytes()``); None where they cannot tell. Errors in ``spec`` raise as in
    :func:`build_dataset`."""
    if spec.partition(":")[0] not in DATASETS:  # folder:PATH, a user's function: unknown
        return None
    _, options = read_dataset_spec(spec)
    size = getattr(options, "memory_bytes", None)
    return size() if size is not None else None
