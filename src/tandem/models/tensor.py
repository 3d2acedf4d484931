"""Tensor plans: which layers of a model split across T workers, and how.

Usage::

    plan = tensor_plan("gpt", model, degree=2)          # a reference model's own plan
    # {"1.attention.qkv": "heads", "1.attention.proj": "rowwise", "1.mlp.0": "colwise", ...}
    plan = tensor_plan(None, model, 2, {"fc1": "colwise", "fc2": "rowwise"})   # any model

A tensor plan maps a module's name (as ``named_modules`` gives it) to a split *style*:

- ``colwise``: a linear layer whose output features are split (each worker computes its share
  of the outputs from the whole input);
- ``rowwise``: a linear layer whose input features are split (each worker multiplies its
  share of the inputs; the partial outputs are summed by one allreduce, then the bias added);
- ``heads``: a fused query/key/value linear layer (``3 * dim`` outputs, the queries first,
  then the keys, then the values) split by attention heads: each worker computes the queries,
  keys and values of its ``heads / T`` heads;
- ``channels``: an ``nn.Conv2d`` whose output channels are split; the shares are gathered
  after it, so the layers that follow see every channel.

A linear layer is an ``nn.Linear`` or a Hugging Face ``Conv1D`` (GPT-2's: its weight is the
transpose of ``nn.Linear``'s, ``(inputs, outputs)``, so its output features are its weight's
columns; :func:`is_conv1d`).

The module that holds a ``heads`` layer (its attention) computes on a worker's share of the
heads. Where it counts the whole layer's heads or width in an integer attribute
(:data:`HEAD_COUNTS`; :data:`WIDTHS` equal to the layer's query width, such as GPT-2's
``split_size``, by which it splits the fused output), each worker sets the attribute to its
share's (:func:`head_shares`); the run names what it set. Other attributes are left as they are,
so its forward must count anything else from its input (``view(..., -1, head_dim)``).

Megatron-LM's pairing: a ``colwise`` (or ``heads``) layer feeds the ``rowwise`` one after it,
so the pair needs one allreduce in the forward (after the row-wise layer) and one in the backward
(before the column-wise layer). Layers the plan does not name stay whole on every worker.

**A user's model** gets a plan from the run's plan (``Plan.tensor_layers``: ``--tensor-layers
fc1=colwise,fc2=rowwise`` on the command line, ``tensor_layers={"fc1": "colwise", ...}`` in
``tandem.fit``, ``"tensor_layers": {...}`` in a plan file), which also replaces a reference
model's own. Pairs are read in the model's module order (``named_modules``): the ``colwise`` and
``heads`` layers before a ``rowwise`` one, since the previous ``rowwise``, are taken to feed it
and hand it only their shares (so what runs between them must work on a share: elementwise
functions, and attention that counts its heads from its input, ``view(..., -1, head_dim)``). A
``colwise`` layer with no ``rowwise`` after it gathers its whole output, and a ``rowwise`` layer
with none before it takes its share of a whole input, so either alone computes what the whole
layer does (at the cost of one more collective); a ``heads`` layer needs its ``rowwise`` layer.

:mod:`tandem.runtime.tensor_parallel` applies a plan. Every check here is of the model alone, so
``tandem train`` runs it before any worker starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from torch import nn

from tandem.errors import UsageError
from tandem.plan import TENSOR_STYLES

STYLES = TENSOR_STYLES
"""The split styles a tensor plan may name (see the module docstring)."""

TensorPlan = dict[str, str]


def tensor_plan(spec: str | None, model: nn.Module, degree: int,
                layers: TensorPlan | None = None) -> TensorPlan:
    """The plan that splits ``model`` across ``degree`` workers: ``layers`` (the run's plan's
    ``tensor_layers``) checked against the model, or else the reference model's own plan
    (``--model spec``: ``mlp``, ``gpt``, ``vgg``; None: the user's own model object); one line
    naming the value and the fix if it cannot."""
    name = None if spec is None else spec.partition(":")[0]
    if layers is not None:
        _check_no_dropout(name if name in TENSOR_PLANS else None, model, degree)
        return checked_layers(model, layers, degree)
    if name not in TENSOR_PLANS:
        what = "your own model" if name is None else f"--model {spec}"
        raise UsageError(f"--tensor-parallel {degree} splits the reference models "
                         f"{', '.join(TENSOR_PLANS)} only, and {what} is not one of them; name "
                         f"its layers to split with --tensor-layers (e.g. fc1=colwise,fc2=rowwise;"
                         f" see README's Tensor parallelism), or drop --tensor-parallel")
    _check_no_dropout(name, model, degree)
    return TENSOR_PLANS[name](model, degree)


def checked_layers(model: nn.Module, layers: TensorPlan, degree: int) -> TensorPlan:
    """``layers`` in the model's module order, once every name is a module of ``model`` of the
    type its style splits, ``degree`` divides what it splits (a ``heads`` layer's heads too,
    where its attention counts them: :func:`head_shares`), no split parameter is shared with
    another module, and every ``heads`` layer has a ``rowwise`` layer after it."""
    modules = dict(model.named_modules())
    for name, style in layers.items():
        if name not in modules:
            raise UsageError(f"tensor layer {name!r} is not a module of the model; "
                             f"{_suggest(name, modules)}")
        _check_style(name, style, modules[name], degree)
    _check_untied(model, layers)
    ordered = {name: layers[name] for name in modules if name in layers}
    open_heads = None
    for name, style in ordered.items():
        if style == "heads":
            open_heads = name
        elif style == "rowwise":
            open_heads = None
    if open_heads is not None:
        raise UsageError(f"tensor layer {open_heads!r} (heads) has no rowwise layer after it in "
                         f"the model's module order to take its heads' outputs; name the "
                         f"attention's output projection rowwise, or split {open_heads!r} colwise")
    head_shares(model, ordered, degree)
    return ordered


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (``transformers.pytorch_utils``: a linear
    layer ``y = x @ weight + bias`` with ``weight`` of shape ``(nx, nf)``, inputs by outputs),
    recognised by its class name and sizes so that tandem need not import transformers."""
    return (type(module).__name__ == "Conv1D" and isinstance(vars(module).get("nf"), int)
            and isinstance(vars(module).get("nx"), int))


def is_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer the ``colwise``, ``rowwise`` and ``heads`` styles
    split: an ``nn.Linear`` or a ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def linear_features(module: nn.Module) -> tuple[int, int]:
    """The input and output features of a linear layer (:func:`is_linear`)."""
    if is_conv1d(module):
        return int(vars(module)["nx"]), int(vars(module)["nf"])
    assert isinstance(module, nn.Linear), f"not a linear layer: {module}"
    return module.in_features, module.out_features


def output_dim(module: nn.Module, key: str) -> int:
    """The dimension of a linear layer's parameter ``key`` that holds its output features: 0
    for a bias and an ``nn.Linear``'s weight (outputs x inputs), 1 for a ``Conv1D``'s weight
    (inputs x outputs)."""
    return 1 if key == "weight" and is_conv1d(module) else 0


SPLITS: dict[str, tuple[Callable[[nn.Module], bool], str]] = {
    "colwise": (is_linear, "an nn.Linear or a Conv1D"),
    "rowwise": (is_linear, "an nn.Linear or a Conv1D"),
    "heads": (is_linear, "an nn.Linear or a Conv1D"),
    "channels": (lambda module: isinstance(module, nn.Conv2d), "an nn.Conv2d"),
}
"""What each style splits: the test of a module, and its words."""


def split_size(style: str, module: nn.Module) -> tuple[int, str]:
    """The size a style divides among the workers, and what it is."""
    if isinstance(module, nn.Conv2d):
        return module.out_channels, "output channels"
    inputs, outputs = linear_features(module)
    if style == "rowwise":
        return inputs, "input features"
    if style == "heads":
        return outputs // 3, "query (key, value) features"
    return outputs, "output features"


def _check_style(name: str, style: str, module: nn.Module, degree: int) -> None:
    splits, what = SPLITS[style]
    if not splits(module):
        fits = [other for other, (test, _) in SPLITS.items() if test(module)]
        fix = (f"use {' or '.join(fits)}" if fits
               else "name an nn.Linear, Conv1D or nn.Conv2d inside it instead")
        raise UsageError(f"tensor layer {name!r} is a {type(module).__name__}, but style "
                         f"{style} splits {what}; {fix}")
    if style == "heads" and linear_features(module)[1] % 3:
        raise UsageError(f"tensor layer {name!r} (heads) has {linear_features(module)[1]} "
                         f"outputs, not queries, keys and values of one size (3 x dim); use "
                         f"colwise")
    size, what = split_size(style, module)
    if size % degree:
        raise UsageError(f"--tensor-parallel {degree} does not divide the {size} {what} of "
                         f"tensor layer {name!r} ({style}); {_degrees(size)}leave {name!r} whole")


def _divisors(size: int) -> list[int]:
    """The first few tensor degrees that divide ``size``."""
    return [d for d in range(2, size + 1) if size % d == 0][:4]


def _degrees(size: int) -> str:
    """``use --tensor-parallel A or B ..., or `` for the degrees that divide ``size``, if any."""
    choices = _divisors(size)
    return f"use --tensor-parallel {' or '.join(map(str, choices))}, or " if choices else ""


HEAD_COUNTS = ("num_heads", "n_head", "n_heads", "heads", "num_attention_heads")
"""Integer attributes by which an attention module counts its heads (GPT-2's ``num_heads``,
tandem gpt's ``heads``): a worker's share holds ``1 / T`` of them."""
WIDTHS = ("embed_dim", "split_size", "hidden_size", "all_head_size")
"""Integer attributes by which it may hold its query width (GPT-2's ``embed_dim``, and
``split_size``, the size by which it splits its fused query/key/value output): set to the
share's where they equal the ``heads`` layer's query width, left alone otherwise."""


def head_shares(model: nn.Module, plan: TensorPlan, degree: int) -> dict[str, tuple[int, int]]:
    """The integer attributes of the modules holding ``plan``'s ``heads`` layers that count a
    whole layer's heads or width (:data:`HEAD_COUNTS`; :data:`WIDTHS` equal to its query width),
    by full name, each with its whole value and a worker's share of ``degree`` workers:
    ``{"h.0.attn.num_heads": (2, 1), "h.0.attn.split_size": (32, 16), ...}``; one line if a
    head count does not split into whole heads."""
    shares: dict[str, tuple[int, int]] = {}
    for name in (name for name, style in plan.items() if style == "heads"):
        owner = name.rpartition(".")[0]
        width, _ = split_size("heads", model.get_submodule(name))
        for attribute, value in vars(model.get_submodule(owner)).items():
            full = f"{owner}.{attribute}" if owner else attribute
            if isinstance(value, bool) or not isinstance(value, int):
                continue
            if attribute in HEAD_COUNTS:
                _check_heads(name, full, value, width, degree)
                shares[full] = (value, value // degree)
            elif attribute in WIDTHS and value == width:
                shares[full] = (value, value // degree)
    return shares


def _check_heads(name: str, full: str, heads: int, width: int, degree: int) -> None:
    if heads < 1 or width % heads:
        raise UsageError(f"tensor layer {name!r} (heads) has {width} query features, which "
                         f"{full} = {heads} heads cannot share equally, so a worker's heads are "
                         f"unknown; leave {name!r} and its rowwise layer whole")
    if heads % degree:
        raise UsageError(f"--tensor-parallel {degree} does not divide the {heads} heads of "
                         f"tensor layer {name!r} ({full}), so a worker would hold part of a "
                         f"head; {_degrees(heads)}leave {name!r} and its rowwise layer whole")


def _check_untied(model: nn.Module, layers: TensorPlan) -> None:
    """A parameter of a split layer that another module also holds (tied weights, such as an
    embedding and an output layer) would be split in one place and whole in the other."""
    owners: dict[int, list[str]] = {}
    for full, parameter in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(parameter), []).append(full)
    for names in owners.values():
        split = [full for full in names if full.rpartition(".")[0] in layers]
        if split and len(names) > 1:
            other = next(full for full in names if full != split[0])
            raise UsageError(f"tensor layer {split[0].rpartition('.')[0]!r} has its parameter "
                             f"{split[0]!r} tied to {other!r} (the same tensor); splitting one "
                             f"would untie them: leave it whole, or untie them in the model")


def _suggest(name: str, modules: dict[str, nn.Module]) -> str:
    """Close module names, those of splittable layers first."""
    splittable = [other for other, module in modules.items()
                  if is_linear(module) or isinstance(module, nn.Conv2d)]
    close = (difflib.get_close_matches(name, splittable, n=3, cutoff=0.5)
             or difflib.get_close_matches(name, [m for m in modules if m], n=3, cutoff=0.5))
    if close:
        return f"did you mean {' or '.join(map(repr, close))}?"
    shown = ", ".join(splittable[:6]) + (", ..." if len(splittable) > 6 else "")
    return (f"its linear and convolution layers are: {shown}" if splittable
            else "it has no nn.Linear, Conv1D or nn.Conv2d to split")


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
            assert isinstance(width, int)  # mlp[first] is an nn.Linear
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
        choices = _divisors(size)
        fix = (f"use --tensor-parallel {' or '.join(map(str, choices))}" if choices
               else "drop --tensor-parallel")
        raise UsageError(f"--tensor-parallel {degree} does not divide {what}; {fix}, or change "
                         f"{option} to a multiple of {degree}")


def _check_no_dropout(name: str | None, model: nn.Module, degree: int) -> None:
    """Dropout would draw other masks on a worker's share of a layer than one process draws on
    the whole layer, so tensor-parallel training would not be single-process training."""
    for module_name, module in model.named_modules():
        rate = module.p if isinstance(module, nn.Dropout) else getattr(module, "dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            fix = (f"use {name}:dropout=0" if name is not None
                   else "set the model's dropout probabilities to 0")
            raise UsageError(f"--tensor-parallel {degree} needs a model without dropout (module "
                             f"{module_name or name or 'the model'} drops {rate:g}; its masks on "
                             f"a worker's share would differ from one process's); {fix}")
