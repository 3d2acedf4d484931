"""Splitting any traceable model into blocks, in one process: the blocks compute the model."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from tandem.data.info import DataInfo
from tandem.errors import UsageError
from tandem.split import BATCH, SplitModel, split_model
from tests import split_models

pytestmark = pytest.mark.pure

IMAGES = DataInfo(task="classify", input_shape=(1, 8, 8), num_classes=10)
TOKENS = DataInfo(task="lm", input_shape=(8,), num_classes=32)


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 1, 8, 8)


def tokens(vocab: int, length: int) -> Callable[[int], torch.Tensor]:
    return lambda n: torch.randint(0, vocab, (n, length))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "skip_bn": (lambda: split_models.skip_bn(IMAGES), images),
    "tied_lm": (lambda: split_models.tied_lm(TOKENS), tokens(32, 8)),
    "in_place": (lambda: split_models.in_place(IMAGES), images),
    "gpt2": (gpt2, tokens(64, 16)),
}


def floats(output: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]


def objective(output: Any) -> torch.Tensor:
    return sum((t.double() ** 2).mean() for t in floats(output))  # type: ignore[return-value]


def split_parameters(split: SplitModel) -> dict[str, nn.Parameter]:
    """Every model name of every parameter the blocks hold."""
    found = {}
    for block in split:
        for key, param in block.named_parameters(remove_duplicate=False):
            found.update(dict.fromkeys(split.model_names(key), param))
    return found


def built(name: str) -> tuple[nn.Module, SplitModel, Callable[[int], torch.Tensor]]:
    """The model, a split of an identical copy, and its inputs (fresh copies each time)."""
    model, split = copy.deepcopy(_built(name))
    return model, split, MODELS[name][1]


@functools.cache
def _built(name: str) -> tuple[nn.Module, SplitModel]:
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    model = make()
    return model, split_model(copy.deepcopy(model), inputs(2))


@pytest.mark.parametrize("name", list(MODELS))
def test_blocks_compute_the_model_and_its_gradients(name: str) -> None:
    model, split, inputs = built(name)
    x = inputs(5)
    expected, got = model(x), split(x)
    assert type(got) is type(expected)
    for a, b in zip(floats(expected), floats(got), strict=True):
        assert (a - b).abs().max() <= 1e-6
    objective(expected).backward()
    objective(got).backward()
    params = split_parameters(split)
    assert params.keys() == dict(model.named_parameters(remove_duplicate=False)).keys()
    for key, param in model.named_parameters():
        assert (param.grad - params[key].grad).abs().max() <= 1e-6, key
    state = split.model_state_dict()
    assert list(state) == list(model.state_dict())  # the user's names, BatchNorm's statistics too
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("name", ["skip_bn", "gpt2"])
def test_evaluation_mode_and_any_batch_size(name: str) -> None:
    model, split, inputs = built(name)
    model.eval()
    split.eval()
    for size in (1, 3, 7):
        x = inputs(size)
        for a, b in zip(floats(model(x)), floats(split(x)), strict=True):
            assert (a - b).abs().max() <= 1e-6


def test_a_skip_connection_carries_two_tensors_and_buffers_stay_with_their_block() -> None:
    _, split, _ = built("skip_bn")
    labels = [block.label for block in split]
    assert labels[:3] == ["stem", "bn", "top:relu"] and labels[-1] == "head"
    inside = split.boundaries[labels.index("conv2") - 1]
    assert len(inside) == 2  # the skip tensor and the main path
    assert all(spec.shape == (BATCH, 4, 8, 8) and spec.requires_grad for spec in inside)
    holders = [i for i, block in enumerate(split) if "bn1.running_mean" in block.state_dict()]
    assert holders == [labels.index("bn1")]


def test_tied_weights_are_one_parameter_in_two_blocks() -> None:
    _, split, _ = built("tied_lm")
    first, last = split[0], split[-1]
    assert first.embed.weight is last.embed.weight
    assert split.aliases == {"embed.weight": ("embed.weight", "out.weight")}


def test_a_received_tensor_updated_in_place_is_copied_first() -> None:
    """Run each block on leaves that require grad, as a pipeline stage receives them."""
    _, split, inputs = built("in_place")
    x: Any = inputs(4)
    for index, block in enumerate(split):
        if index:
            x = tuple(t.detach().requires_grad_(spec.requires_grad)
                      for t, spec in zip(x, split.boundaries[index - 1]))
        out = block(x)
        if index:
            objective(out).backward()  # no "leaf Variable ... used in an in-place operation"
            assert all(t.grad is not None for t in x if t.requires_grad)
        x = out
    updating = next(block for block in split if block.label.startswith("top:add_"))
    assert "clone" in updating.code  # it updates `h`, which it received


def test_user_split_points() -> None:
    model, _, inputs = built("gpt2")
    split = split_model(model, inputs(2), split_points=["transformer.h.1", "lm_head"])
    assert [block.label for block in split] == [
        "transformer:view..transformer.h.0", "transformer.h.1..transformer.ln_f", "lm_head"]
    x = inputs(3)
    assert (split(x).logits - model(x).logits).abs().max() <= 1e-6
    with pytest.raises(UsageError, match="'transformer.h.9' is not a submodule"):
        split_model(model, inputs(2), split_points=["transformer.h.9"])


def test_max_blocks_picks_a_shallower_level() -> None:
    model, split, inputs = built("gpt2")
    coarse = split_model(model, inputs(2), max_blocks=16)
    assert len(coarse) <= 16 < len(split)
    assert "transformer.h.0" in [block.label for block in coarse]


def test_an_untraceable_model_is_one_line_naming_the_operation() -> None:
    model = split_models.value_branch(IMAGES)
    with pytest.raises(UsageError) as caught:
        split_model(model, images(2), what="model 'tests.split_models:value_branch'")
    message = str(caught.value)
    assert "\n" not in message
    assert "split_models.py" in message and "`if h.sum() > 0:`" in message
    assert "nn.Sequential" in message


def test_leaves_are_called_as_the_models_own_modules() -> None:
    """A leaf's stretch of the trace becomes one call of the model's module (so a tensor split
    of it takes effect in the block); the blocks still compute the model, gradients alike."""
    make, inputs = MODELS["gpt2"]
    torch.manual_seed(0)
    model = make()
    leaves = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj"]
    split = split_model(model, inputs(2), leaves=leaves)
    for name in leaves:
        block = split[split.leaves[name]]
        assert block.leaf_names == (name,) and f".{name.rpartition('.')[2]}(" in block.code
        assert block.get_submodule(name) is model.get_submodule(name)
    x = inputs(3)
    assert (split(x).logits - model(x).logits).abs().max() == 0


def test_a_module_that_cannot_be_called_alone_is_one_line() -> None:
    make, inputs = MODELS["tied_lm"]
    model = make()  # the model's own code runs between its layers
    with pytest.raises(UsageError) as raised:
        split_model(model, inputs(2), leaves=["layers"])
    message = str(raised.value)
    assert "module 'layers' runs more than once" in message and "tensor layers" in message and "\n" not in message


def test_a_split_traced_on_the_meta_device_runs_bound_to_the_models_tensors() -> None:
    """Traced on the meta device (its code names that device: GPT-2's ``arange``), then the
    model given storage: the blocks take the model's new tensors by name and run their code on
    the CPU, computing what the model does."""
    model, _, inputs = built("gpt2")
    with torch.device("meta"):
        shell = gpt2()
    split = split_model(shell, inputs(2).to("meta"))
    assert any("device(type='meta')" in block.code for block in split)
    shell.to_empty(device="cpu")
    shell.load_state_dict(model.state_dict())
    split.bind(shell)
    split.place_code(torch.device("cpu"))
    assert not any(t.is_meta for t in (*split.parameters(), *split.buffers()))
    tie = [param for block in split for name, param in block.named_parameters()
           if name == "transformer.wte.weight"]
    assert len(tie) == 2 and tie[0] is tie[1] is shell.transformer.wte.weight
    x = inputs(3)
    torch.testing.assert_close(floats(split(x)), floats(model(x)), rtol=0, atol=0)
