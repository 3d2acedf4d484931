"""Tensor plans of the reference models: which of their layers split across T workers, and how.

Usage::

    plan = tensor_plan("gpt", model, degree=2)
    # {"1.attention.qkv": "heads", "1.attention.proj": "rowwise", "1.mlp.0": "colwise", ...}

A tensor plan maps a module's name (as ``named_modules`` gives it) to a split *style*:

- ``colwise``: an ``nn.Linear`` whose output features are split (each worker computes its share
  of the outputs from the whole input);
- ``rowwise``: an ``nn.Linear`` whose input features are split (each worker multiplies its
  share of the inputs; the partial outputs are summed by one allreduce, then the bias added);
- ``heads``: a fused query/key/value ``nn.Linear`` (``3 * dim`` outputs) split by attention
  heads: each worker computes the queries, keys and values of its ``heads / T`` heads;
- ``channels``: an ``nn.Conv2d`` whose output channels are split; the shares are gathered
  after it, so the layers that follow see every channel.

Megatron-LM's pairing: a ``colwise`` (or ``heads``) layer feeds the ``rowwise`` one after it,
so the pair needs one allreduce in the forward (after the row-wise layer) and one in the backward
(before the column-wise layer). Layers the plan does not name stay whole on every worker.
:mod:`tandem.runtime.tensor_parallel` applies a plan. Every check here is of the model alone, so
``tandem train`` runs it before any worker starts.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tandem.errors import UsageError

STYLES = ("colwise", "rowwise", "heads", "channels")
"""The split styles a tensor plan may name (see the module docstring)."""

TensorPlan = dict[str, str]


def tensor_plan(spec: str | None, model: nn.Module, degree: int) -> TensorPlan:
    """The plan that splits the reference model of ``--model spec`` (``mlp``, ``gpt``, ``vgg``;
    None: the user's own model object) across ``degree`` workers; one line naming the value and
    the fix if it cannot."""
    name = None if spec is None else spec.partition(":")[0]
    if name not in TENSOR_PLANS:
        what = "your own model" if name is None else f"--model {spec}"
        raise UsageError(f"--tensor-parallel {degree} splits the reference models "
                         f"{', '.join(TENSOR_PLANS)} only, and {what} is not one of them; use "
                         f"one of those, or drop --tensor-parallel")
    _check_no_dropout(name, model, degree)
    return TENSOR_PLANS[name](model, degree)


def block_allreduces(plan: TensorPlan, num_blocks: int) -> list[tuple[int, int]]:
    """Allreduces the plan adds to the forward and to the backward of each top-level block of an
    ``nn.Sequential`` (module names ``"<block>.<...>"``): one forward after each ``rowwise``
    layer; one backward before each ``colwise`` or ``heads`` layer; a ``channels`` layer one each
    way (its forward all-gather counted as one). ``(0, 0)``: the block stays whole."""
    counts = [[0, 0] for _ in range(num_blocks)]
    for name, style in plan.items():
        block = int(name.split(".", 1)[0])
        counts[block][0] += style in ("rowwise", "channels")
        counts[block][1] += style in ("colwise", "heads", "channels")
    return [(forward, backward) for forward, backward in counts]


def mlp_plan(model: nn.Module, degree: int) -> TensorPlan:
    """Consecutive linear layers in pairs, column-wise then row-wise; an odd last one whole."""
    linears = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear)]
    plan: TensorPlan = {}
    for (first, layer), (second, _) in zip(linears[0::2], linears[1::2]):
        _divides(degree, layer.out_features, f"the hidden size of mlp ({layer.out_features}, "
                 f"the outputs of layer {first})", "mlp:hidden=")
        plan[first], plan[second] = "colwise", "rowwise"
    return plan


def gpt_plan(model: nn.Module, degree: int) -> TensorPlan:
    """In every transformer block: attention by heads (then its output projection row-wise),
    the MLP's first linear layer column-wise and its second row-wise. The embeddings, layer
    norms and the vocabulary projection stay whole."""
    plan: TensorPlan = {}
    for name, module in model.named_modules():
        heads = getattr(module, "heads", None)
        if isinstance(heads, int) and isinstance(getattr(module, "qkv", None), nn.Linear):
            _divides(degree, heads, f"gpt's attention heads ({heads})", "gpt:heads=")
            plan[f"{name}.qkv"], plan[f"{name}.proj"] = "heads", "rowwise"
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, nn.Sequential):
            first, second = [index for index, layer in enumerate(mlp)
                             if isinstance(layer, nn.Linear)]
            width = mlp[first].out_features
            _divides(degree, width, f"the hidden size of gpt's MLP ({width} = mlp_ratio x dim)",
                     "gpt:mlp_ratio=")
            plan[f"{name}.mlp.{first}"], plan[f"{name}.mlp.{second}"] = "colwise", "rowwise"
    return plan


def vgg_plan(model: nn.Module, degree: int) -> TensorPlan:
    """Every convolution by output channels; the first two of the three linear layers as a
    column-wise/row-wise pair (the classifier, most of the parameters), the last one whole."""
    plan: TensorPlan = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            _divides(degree, module.out_channels, f"the {module.out_channels} output channels "
                     f"of vgg's convolution {name}", "vgg:width=")
            plan[name] = "channels"
    linears = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear)]
    if len(linears) >= 2:
        (first, layer), (second, _) = linears[0], linears[1]
        _divides(degree, layer.out_features, f"vgg's hidden size ({layer.out_features}, the "
                 f"outputs of layer {first})", "vgg:hidden=")
        plan[first], plan[second] = "colwise", "rowwise"
    return plan


TENSOR_PLANS: dict[str, Callable[[nn.Module, int], TensorPlan]] = {
    "mlp": mlp_plan, "gpt": gpt_plan, "vgg": vgg_plan,
}
"""Reference model name -> the function that writes its tensor plan."""


def _divides(degree: int, size: int, what: str, option: str) -> None:
    if size % degree:
        choices = [d for d in range(2, size + 1) if size % d == 0][:4]
        fix = (f"use --tensor-parallel {' or '.join(map(str, choices))}" if choices
               else "drop --tensor-parallel")
        raise UsageError(f"--tensor-parallel {degree} does not divide {what}; {fix}, or change "
                         f"{option} to a multiple of {degree}")


def _check_no_dropout(name: str, model: nn.Module, degree: int) -> None:
    """Dropout would draw other masks on a worker's share of a layer than one process draws on
    the whole layer, so tensor-parallel training would not be single-process training."""
    for module_name, module in model.named_modules():
        rate = module.p if isinstance(module, nn.Dropout) else getattr(module, "dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            raise UsageError(f"--tensor-parallel {degree} needs a model without dropout (module "
                             f"{module_name or name} drops {rate:g}; its masks on a worker's "
                             f"share would differ from one process's); use {name}:dropout=0")
