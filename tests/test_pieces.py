"""Models built on the meta device and given storage one module at a time
(:mod:`tandem.models.pieces`) against the same models built whole under the same seed: a user's
model with a skip connection, BatchNorm buffers, an in-place ReLU and tied weights (its
modules' ``reset_parameters`` in order), a user's ``init_fn`` (against the model built whole and
then initialized module by module), a built-in model (by module name); and the one-line refusals
of what cannot be built so."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tandem.data import DataInfo, load_data
from tandem.errors import UsageError
from tandem.models import build_model
from tandem.models.pieces import Initializer, materialize
from tandem.runtime.config import RunConfig
from tandem.runtime.task import Task, UserObjects


class Tied(nn.Module):
    """Embedding tied to the output layer, a residual block with BatchNorm and in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True))
        self.skip = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.embed.weight = self.head.weight  # the later module's tensor, as nanoGPT ties

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.block(x) + self.skip(x))


class NoReset(nn.Module):
    """A module holding a weight of its own without ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


class UnsetBuffer(nn.Linear):
    """A layer whose buffer is computed in its constructor and not by ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("table", torch.arange(4.0))


class UnsetIndex(nn.Linear):
    """The same with an integer buffer (positions)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("positions", torch.arange(4))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    left, right = _state(a), _state(b)
    assert list(left) == list(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


def _on_meta(build: type[nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


@pytest.mark.pure
def test_reset_parameters_in_order_equals_the_model_built_whole() -> None:
    torch.manual_seed(5)
    whole = Tied()
    pieces = _on_meta(Tied)
    materialize(pieces, Initializer(seed=5, by_name=False), torch.device("cpu"))
    _assert_same(whole, pieces)
    assert pieces.head.weight is pieces.embed.weight  # the tie holds, with the head's values
    after_whole = torch.rand(3)
    torch.manual_seed(5)
    Tied()
    assert torch.equal(torch.rand(3), after_whole)  # and the generator ends where it would


def init_small(module: nn.Module, name: str) -> None:
    """A user's initializer: normal(0, 0.02) weights, zero biases, scaled output layer."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        std = 0.02 / math.sqrt(2) if name == "head" else 0.02
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    else:
        module.reset_parameters()


@pytest.mark.pure
def test_a_users_init_fn_equals_the_whole_model_initialized_module_by_module() -> None:
    torch.manual_seed(9)
    whole = Tied()
    torch.manual_seed(9)
    for name, module in whole.named_modules():
        if any(True for _ in module.parameters(recurse=False)) or \
                any(True for _ in module.buffers(recurse=False)):
            init_small(module, name)
    pieces = _on_meta(Tied)
    materialize(pieces, Initializer(seed=9, by_name=False, function=init_small),
                torch.device("cpu"))
    _assert_same(whole, pieces)
    assert float(pieces.skip.weight.std()) < 0.05  # the user's, not reset_parameters'


@pytest.mark.pure
def test_a_built_in_model_built_in_pieces_equals_it_built_whole() -> None:
    whole = build_model("gpt:layers=2,dim=32,heads=4", _tokens_info(), seed=7)
    pieces = build_model("gpt:layers=2,dim=32,heads=4", _tokens_info(), seed=7, device="meta")
    done: list[str] = []
    stats = materialize(pieces, Initializer(seed=7, by_name=True), torch.device("cpu"),
                        units=["1", "2"], done=done.append)
    _assert_same(whole, pieces)
    assert done == ["1", "2", ""]  # each unit once complete, the model last
    whole_bytes = sum(t.numel() * t.element_size() for t in whole.state_dict().values())
    assert 0 < stats.peak_whole_bytes <= whole_bytes


def _tokens_info() -> DataInfo:
    return load_data("tokens:n=64,seq=12,vocab=32").info


@pytest.mark.pure
@pytest.mark.parametrize(("build", "named"), [(NoReset, "'(the model)' (NoReset)"),
                                              (UnsetBuffer, "table (UnsetBuffer)"),
                                              (UnsetIndex, "positions (UnsetIndex)")])
def test_what_cannot_be_built_in_pieces_is_one_line_with_the_way_out(
        build: type[nn.Module], named: str) -> None:
    model = _on_meta(build)
    with pytest.raises(UsageError, match="--init-fn") as info:
        materialize(model, Initializer(seed=0, by_name=False), torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message and named in message, message


def tied_model() -> nn.Module:
    """``--model tests.test_pieces:tied_model``."""
    return Tied()


@pytest.mark.pure
def test_a_task_builds_a_users_builder_with_init_fn_as_the_builder_would() -> None:
    run = RunConfig(model="tests.test_pieces:tied_model", data="digits", seed=4, init_fn="reset")
    task = Task(run)
    torch.manual_seed(4)
    pieces = task.build_model()
    torch.manual_seed(4)
    _assert_same(Tied(), pieces)
    assert task.build_model(meta=True).embed.weight.is_meta


@pytest.mark.pure
def test_init_fn_is_refused_where_tandem_does_not_build_the_model() -> None:
    with pytest.raises(UsageError, match="built-in model 'mlp'.*drop --init-fn"):
        RunConfig(model="mlp", init_fn="reset")
    import tandem

    with pytest.raises(UsageError, match="already built.*drop init_fn"):
        tandem.fit(Tied(), data="digits", init_fn="reset")
    assert UserObjects().init_fn is None


def digits_net() -> nn.Module:
    """A user's builder for digits (8x8 images, 10 classes)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


@pytest.mark.multiprocess
def test_fit_builds_a_users_builder_in_pieces_with_init_fn_reset() -> None:
    """A builder given to ``tandem.fit`` is named ``module:function`` (was ``module.function``,
    taken for a built-in model's name, so ``init_fn="reset"`` was refused)."""
    import tandem

    summary = tandem.fit(digits_net, data="digits", init_fn="reset", steps=2, nproc=1).summary
    assert summary["finished"] and summary["model"] == "tests.test_pieces:digits_net"


@pytest.mark.pure
def test_a_units_whole_tensors_are_freed_once_it_is_done() -> None:
    """What ``done`` drops of a unit (FSDP2 keeps a shard) is freed: the builder keeps no
    reference to the whole tensors it made, only to weights that several modules share."""
    import weakref

    model = _on_meta(Tied)
    dropped: list[weakref.ref[torch.Tensor]] = []

    def shard(unit: str) -> None:
        if unit == "block":
            for module in model.block.modules():
                for key, tensor in list(module._parameters.items()):  # noqa: SLF001
                    if tensor is not None:
                        dropped.append(weakref.ref(tensor))
                        module._parameters[key] = nn.Parameter(tensor.detach()[:1].clone())  # noqa: SLF001

    materialize(model, Initializer(seed=1, by_name=False), torch.device("cpu"),
                units=["block"], done=shard)
    assert len(dropped) == 4 and all(ref() is None for ref in dropped)  # Linear, BatchNorm
    assert model.head.weight is model.embed.weight  # the shared one was kept to tie them


@pytest.mark.pure
def test_an_init_fn_with_a_defaulted_second_parameter_gets_the_module_alone() -> None:
    seen: list[float] = []

    def init(module: nn.Module, std: float = 0.5) -> None:
        seen.append(std)
        module.reset_parameters()

    model = _on_meta(lambda: nn.Linear(3, 3))
    materialize(model, Initializer(seed=0, by_name=False, function=init), torch.device("cpu"))
    assert seen == [0.5]


BUILT_ON: list[str] = []
"""Where :func:`probe_builder` found torch's default device: ``meta`` when built in pieces."""


def probe_builder() -> nn.Module:
    """``--model tests.test_pieces:probe_builder``: a small classifier of digits."""
    BUILT_ON.append(torch.empty(0).device.type)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


@pytest.mark.pure
def test_the_checks_before_launch_build_a_sharded_jobs_model_on_the_meta_device() -> None:
    """No process builds a model whole that its workers build in pieces: the checks before
    launch (one sample through it, the loss, memory) take it on the meta device; a model that
    cannot be built in pieces, or a plain data-parallel job's, is still run for real."""
    from tandem.runtime.job import Job
    from tandem.runtime.run import check_job
    from tandem.strategy import plan_from_flags

    for flags, init_fn, whole in (({"--shard": 2}, "reset", False),
                                  ({"--shard": 2}, None, True),  # nothing says how: whole
                                  ({}, None, True)):
        run = RunConfig(model="tests.test_pieces:probe_builder", data="digits", nproc=2,
                        init_fn=init_fn)
        BUILT_ON.clear()  # (its size is read from a build on the meta device either way)
        check_job(Job(run=run, plan=plan_from_flags("dp", flags, num_processes=2,
                                                    num_blocks=None)))
        assert ("cpu" in BUILT_ON) == whole, (flags, init_fn, BUILT_ON)
