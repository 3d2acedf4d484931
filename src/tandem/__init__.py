"""tandem: train one neural network on many devices with PyTorch.

Usage::

    import tandem

    result = tandem.fit(my_module, train_set, test_set, loss=my_loss, strategy="dp",
                        nproc=2, steps=200, batch_size=64)

(see :mod:`tandem.api`; ``tandem train`` runs the same jobs from the command line).
"""

from tandem.errors import UsageError

__all__ = ["Callback", "FitResult", "StepInfo", "UsageError", "__version__", "fit"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``tandem.fit`` and ``tandem.FitResult`` (imported on first use: they need torch), and
    ``tandem.Callback`` and ``tandem.StepInfo`` for ``fit``'s callbacks."""
    if name in ("fit", "FitResult", "Callback", "StepInfo"):
        from tandem import api  # delays torch

        return getattr(api, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
