"""tandem: train one neural network on many devices with PyTorch.

Usage::

    from tandem.models import build_model
    from tandem.data import build_dataset

    data = build_dataset("digits")
    model = build_model("mlp:hidden=128", data.info)
"""

from tandem.errors import UsageError

__all__ = ["UsageError", "__version__"]
__version__ = "0.1.0"
