"""Optimizers as users write them (issue 29, deliverable 2): any ``torch.optim`` class by name
or ``package.module:Class`` with its keyword options, parameter groups (``--no-decay`` and, in
Python, ``param_groups=fn``) and a scheduler of the user's, on every strategy.

AdamW with betas (0.9, 0.95) and no weight decay on norms and biases: one process equals
``torch.optim.AdamW`` over the same groups by hand; data parallelism, synchronous parameter
servers, tensor parallelism and a pipeline, given on the command line and through
``tandem.fit``, equal that one process; so do sharded data parallelism (FSDP2, ZeRO) and a
pipeline stopped and resumed.

Adam on attention: the key part of a query-key-value bias has a zero gradient in exact
arithmetic (softmax ignores a shift shared by every key), so what it gets is rounding noise
(~1e-9) that Adam divides by its own size and turns into steps of the learning rate's order;
any two layouts differ there (DDP with plain Adam too: tests/test_sharded.py). Those entries
(the middle third of each ``qkv.bias``) are held to 1e-3; every other entry to 1e-5.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tandem
from tandem.data import build_dataset
from tandem.errors import UsageError
from tandem.models import build_model
from tests.conftest import SharedRun, run_here, run_json

MODEL, DATA = "gpt:layers=2,dim=32,heads=4,dropout=0", "tokens:n=256,seq=12,vocab=32"
STEPS, BATCH, LR, SEED, DECAY = 8, 16, 0.003, 3, 0.1
RUN = ("--model", MODEL, "--data", DATA, "--steps", str(STEPS), "--batch-size", str(BATCH),
       "--lr", str(LR), "--seed", str(SEED), "--log-every", "4")
ADAMW = ("--optimizer", "adamw", "--optimizer-options", "betas=0.9,0.95", "eps=1e-8",
         "--weight-decay", str(DECAY), "--no-decay", "norm,bias")
LAYOUTS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    # name: (command-line flags, tandem.fit's keyword arguments)
    "dp": (("--nproc", "2"), {"nproc": 2}),
    # two servers: each applies the groups to its shard, by the parameters' names
    "ps sync": (("--strategy", "ps", "--servers", "2", "--mode", "sync", "--nproc", "4"),
                {"strategy": "ps", "servers": 2, "mode": "sync", "nproc": 4}),
    "tensor": (("--nproc", "2", "--tensor-parallel", "2"), {"nproc": 2, "tensor_parallel": 2}),
    "pipeline": (("--strategy", "pipeline", "--stages", "2", "--nproc", "2"),
                 {"strategy": "pipeline", "stages": 2, "nproc": 2}),
}


def no_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The usual transformer recipe by hand: no weight decay on LayerNorms and biases."""
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm)
             for p in m.parameters(recurse=False)}
    rest = [(n, p) for n, p in model.named_parameters()
            if id(p) in norms or n.endswith("bias")]
    kept = {id(p) for _, p in rest}
    return [{"params": [p for p in model.parameters() if id(p) not in kept]},
            {"params": [p for _, p in rest], "weight_decay": 0.0}]


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A scheduler of the user's: the learning rate halves every 3 steps."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def by_hand(groups: Any = no_decay_groups, betas: tuple[float, float] = (0.9, 0.95),
            scheduler: Any = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch on one process: tandem's initialization and shuffled global batches,
    ``torch.optim.AdamW`` over ``groups(model)``, mean cross-entropy per position."""
    data = build_dataset(DATA)
    torch.manual_seed(SEED)
    model = build_model(MODEL, data.info)
    optimizer = torch.optim.AdamW(groups(model), lr=LR, betas=betas, eps=1e-8,
                                  weight_decay=DECAY)
    schedule = scheduler(optimizer) if scheduler is not None else None
    num_samples = len(data.train)
    per_epoch = -(-num_samples // BATCH)
    for step in range(STEPS):
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(num_samples,
                               generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        batch = order[index * BATCH : (index + 1) * BATCH]
        logits = model(data.train.inputs[batch])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               data.train.targets[batch].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
    return model.state_dict()


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Largest difference of two states with the same names: over every entry but the key
    thirds of the query-key-value biases, and over those (see the module docstring)."""
    assert list(a) == list(b)
    rest, keys = 0.0, 0.0
    for name, value in a.items():
        diff = (value.double() - b[name].double()).abs().flatten()
        if name.endswith("qkv.bias"):
            third = diff.numel() // 3
            keys = max(keys, float(diff[third : 2 * third].max()))
            diff = torch.cat([diff[:third], diff[2 * third:]])
        rest = max(rest, float(diff.max()))
    return rest, keys


@pytest.mark.multiprocess
def test_one_process_equals_torch_adamw_with_the_groups_by_hand(shared_run: SharedRun) -> None:
    out, summary = shared_run(*RUN, *ADAMW, "--nproc", "1")
    got = torch.load(out / "final.pt")
    assert summary["finished"] and max(differences(got, by_hand())) <= 1e-6
    # the groups and the betas matter: decay everywhere, or Adam's default betas, end elsewhere
    everything = lambda model: [{"params": list(model.parameters())}]  # noqa: E731
    assert max(differences(got, by_hand(groups=everything))) > 1e-4
    assert max(differences(got, by_hand(betas=(0.9, 0.999)))) > 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize("given", ["command line", "python"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_equals_one_process(shared_run: SharedRun, tmp_path: Path, layout: str,
                                         given: str) -> None:
    single, _ = shared_run(*RUN, *ADAMW, "--nproc", "1")
    flags, kwargs = LAYOUTS[layout]
    if given == "command line":
        out, summary = shared_run(*RUN, *ADAMW, *flags)
    else:
        result = tandem.fit(MODEL, data=DATA, steps=STEPS, batch_size=BATCH, lr=LR, seed=SEED,
                            optimizer="AdamW", optimizer_options={"betas": (0.9, 0.95),
                                                                  "eps": 1e-8},
                            weight_decay=DECAY, param_groups=no_decay_groups, out=tmp_path,
                            **kwargs)
        out, summary = tmp_path, result.summary
    assert summary["finished"] and summary["world_size"] == kwargs["nproc"]
    rest, keys = differences(torch.load(single / "final.pt"), torch.load(out / "final.pt"))
    assert rest <= 1e-5 and keys <= 1e-3, (rest, keys)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [("--shard", "2"), ("--shard", "2", "--shard-level", "1")],
                         ids=["fsdp2", "zero"])
def test_sharded_data_parallelism_equals_one_process(shared_run: SharedRun,
                                                     layout: tuple[str, ...]) -> None:
    """FSDP2's workers step their shards of each group; ZeRO's sharded optimizer keeps the
    groups (and takes AdamW's defaults, one of which its constructor does not)."""
    single, _ = shared_run(*RUN, *ADAMW, "--nproc", "1")
    out, summary = shared_run(*RUN, *ADAMW, "--nproc", "2", *layout)
    assert summary["shard"] == 2
    rest, keys = differences(torch.load(single / "final.pt"), torch.load(out / "final.pt"))
    assert rest <= 1e-5 and keys <= 1e-3, (rest, keys)


@pytest.mark.multiprocess
def test_a_pipeline_resumes_its_groups(shared_run: SharedRun, tmp_path: Path) -> None:
    """Each stage's checkpoint holds both groups (one may be empty), matched by position."""
    single, _ = shared_run(*RUN, *ADAMW, "--nproc", "1")
    pipeline = LAYOUTS["pipeline"][0]
    stopped = run_json("train", *RUN, *ADAMW, *pipeline, "--out", str(tmp_path),
                       "--stop-after", "4")
    assert (stopped["steps"], stopped["finished"]) == (4, False)
    run_json("train", *RUN, *ADAMW, *pipeline, "--out", str(tmp_path), "--resume")
    rest, keys = differences(torch.load(single / "final.pt"), torch.load(tmp_path / "final.pt"))
    assert rest <= 1e-5 and keys <= 1e-3, (rest, keys)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["dp", "ps sync"])
def test_a_users_scheduler_steps_with_the_optimizer(tmp_path: Path, layout: str) -> None:
    """``scheduler=`` on data parallelism and on the servers: the rate halves every 3 steps
    there as it does by hand, through a checkpoint after step 4 (the scheduler's state)."""
    _, kwargs = LAYOUTS[layout]
    settings = dict(data=DATA, steps=STEPS, batch_size=BATCH, lr=LR, seed=SEED,
                    optimizer="adamw", optimizer_options={"betas": (0.9, 0.95), "eps": 1e-8},
                    weight_decay=DECAY, no_decay="norm,bias", scheduler=halving, out=tmp_path,
                    **kwargs)
    assert tandem.fit(MODEL, stop_after=4, **settings).summary["steps"] == 4
    assert tandem.fit(MODEL, resume="auto", **settings).summary["finished"]
    rest, keys = differences(by_hand(scheduler=halving), torch.load(tmp_path / "final.pt"))
    assert rest <= 1e-5 and keys <= 1e-3, (rest, keys)
    assert max(differences(by_hand(), torch.load(tmp_path / "final.pt"))) > 1e-4


# -- names, options and groups, without a run -------------------------------------------------

@pytest.mark.pure
def test_names_options_and_no_decay_are_read_as_written() -> None:
    from tandem.runtime.optimizer_class import optimizer_class
    from tandem.spec.optimizer import canonical_optimizer, no_decay_kinds, parse_options

    assert [optimizer_class(canonical_optimizer(name)) for name in
            ("AdamW", "adamw", "rmsprop", "NAdam", "SGD", "torch.optim:Adagrad")] == [
        torch.optim.AdamW, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.NAdam,
        torch.optim.SGD, torch.optim.Adagrad]
    assert parse_options(["betas=0.9,0.95", "eps=1e-8", "amsgrad=true", "foreach=None",
                          "centered=False", "alpha=2"]) == {
        "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": True, "foreach": None,
        "centered": False, "alpha": 2}
    assert parse_options("betas=0.9,0.95 eps=1e-8") == {"betas": (0.9, 0.95), "eps": 1e-8}
    assert no_decay_kinds("norm, bias,norm") == ("norm", "bias")


class MyRMSNorm(nn.Module):
    """A normalization layer of the user's, known by its class name."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Tied(nn.Module):
    """Every kind ``--no-decay`` names, and an output layer tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.ln = nn.LayerNorm(6)
        self.bn = nn.BatchNorm1d(6)
        self.gn = nn.GroupNorm(2, 6)
        self.rms = MyRMSNorm(6)
        self.attn = nn.MultiheadAttention(6, 2)
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.pure
@pytest.mark.parametrize("kinds, excluded", [
    ("norm", {"ln.weight", "ln.bias", "bn.weight", "bn.bias", "gn.weight", "gn.bias",
              "rms.scale"}),
    ("bias", {"ln.bias", "bn.bias", "gn.bias", "attn.in_proj_bias", "attn.out_proj.bias",
              "fc.bias"}),
    ("embedding", {"embed.weight", "head.weight"}),  # one tensor under both names
])
def test_no_decay_takes_what_it_names_and_nothing_else(kinds: str, excluded: set[str]) -> None:
    from tandem.runtime.param_groups import no_decay_plan

    plan = no_decay_plan(Tied(), (kinds,))
    assert plan.options == ({}, {"weight_decay": 0.0})
    assert {name for name, group in plan.index.items() if group == 1} == excluded


@pytest.mark.pure
def test_every_worker_gets_every_group_in_order() -> None:
    """A stage or a server holding only some parameters still has both groups (a checkpoint's
    groups match by position); a parameter it holds goes to its group by name."""
    from tandem.runtime.learning_rate import build_optimizer
    from tandem.runtime.config import RunConfig
    from tandem.runtime.param_groups import no_decay_plan

    model = Tied()
    plan = no_decay_plan(model, ("norm", "bias"))
    config = RunConfig(optimizer="adamw", weight_decay=0.1)
    part = build_optimizer(config, [("fc.weight", model.fc.weight)], groups=plan)
    assert [len(group["params"]) for group in part.param_groups] == [1, 0]
    assert [group["weight_decay"] for group in part.param_groups] == [0.1, 0.0]
    whole = build_optimizer(config, model.named_parameters(), groups=plan)
    assert [len(group["params"]) for group in whole.param_groups] == [4, 10]


def _only_fc(model: nn.Module) -> Any:
    return [{"params": [model.fc.weight, model.fc.bias]}]


USER_GROUPS: dict[str, tuple[Any, str]] = {
    "a parameter left out": (_only_fc, "param_groups(model) leaves out embed.weight, ln.weight, "
                                       "ln.bias and 9 more, which train; add them to a group"),
    "a parameter twice": (lambda m: [{"params": list(m.parameters())}, {"params": [m.fc.bias]}],
                          "parameter 'fc.bias' is in groups 0 and 1; put it in one"),
    "a foreign tensor": (lambda m: [{"params": [torch.zeros(3)]}],
                         "group 0 holds a tensor of shape (3,), which is not a parameter of "
                         "the model"),
    "an unknown name": (lambda m: [{"params": ["fc.wieght"]}],
                        "group 0 names 'fc.wieght', which is no parameter of the model; did "
                        "you mean 'fc.weight'?"),
    "not dicts": (lambda m: [list(m.parameters())], "group 0 is list, not a dict with 'params'"),
    "a dict": (lambda m: {"params": list(m.parameters())}, "returned dict; return a list"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", USER_GROUPS)
def test_a_users_groups_are_checked_in_one_line(case: str) -> None:
    from tandem.runtime.param_groups import user_plan

    groups, message = USER_GROUPS[case]
    with pytest.raises(UsageError) as caught:
        user_plan(Tied(), groups)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.pure
def test_a_users_groups_by_name_and_frozen_parameters() -> None:
    """Names or ``named_parameters()`` pairs stand for the parameters; a frozen one may be left
    out (it joins the first group and never steps)."""
    from tandem.runtime.param_groups import user_plan

    model = Tied()
    model.ln.weight.requires_grad_(False)
    names = [n for n, p in model.named_parameters() if p.requires_grad and n != "fc.bias"]
    plan = user_plan(model, lambda m: [{"params": names[:3]},
                                       {"params": [("fc.bias", m.fc.bias), *names[3:]],
                                        "lr": 0.1}])
    assert plan.options == ({}, {"lr": 0.1})
    assert plan.index["ln.weight"] == 0 and plan.index["fc.bias"] == 1
    assert plan.index["head.weight"] == plan.index["embed.weight"] == 0


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    # (the run's settings, the one line's words)
    "unknown class": ({"optimizer": "adamx"},
                      "--optimizer 'adamx' is not a torch.optim class (adadelta, "),
    "close name": ({"optimizer": "adamx"}, "did you mean 'adamax'?"),
    "unknown option": ({"optimizer": "adamw", "optimizer_options": ["beta=0.9,0.95"]},
                       "--optimizer-options 'beta': AdamW takes no such option; did you mean "
                       "'betas'? its options: lr, betas, eps, weight_decay, amsgrad"),
    "a bad value": ({"optimizer": "adamw", "optimizer_options": ["betas=0.9"]},
                    "--optimizer adamw --optimizer-options betas=0.9: AdamW refused them"),
    "sgd's momentum": ({"optimizer_options": ["momentum=0.5"]},
                       "sgd's momentum comes from --momentum; give --momentum 0.5"),
    "lr in the options": ({"optimizer_options": {"lr": 0.1}},
                          "the lr comes from --lr; give --lr instead"),
    "no weight decay": ({"optimizer": "rprop", "weight_decay": 0.1},
                        "--weight-decay 0.1: Rprop takes no weight decay"),
    "a closure": ({"optimizer": "LBFGS"}, "LBFGS re-evaluates the model in a closure"),
    "no module": ({"optimizer": "nope.optim:Lion"},
                  "--optimizer nope.optim:Lion: cannot import module 'nope.optim'"),
    "no optimizer": ({"optimizer": "torch.nn:Linear"},
                     "--optimizer torch.nn:Linear is 'type', not a subclass of "
                     "torch.optim.Optimizer"),
    "not a name": ({"optimizer": "adam w"}, "--optimizer 'adam w' is neither a torch.optim "
                                            "class name nor package.module:Class"),
    "lars's groups": ({"optimizer": "lars", "no_decay": "norm,bias"},
                      "lars already keeps biases and normalization parameters"),
    "no-decay of nothing": ({"no_decay": "norms"}, "--no-decay 'norms': 'norms' is not one of "
                                                   "norm, bias, embedding"),
    "matrices split": ({"optimizer": "adafactor", "nproc": 2, "flags": {"--tensor-parallel": 2}},
                       "--optimizer adafactor steps each matrix as a whole, and this plan "
                       "splits parameters"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_apply_is_one_line(case: str) -> None:
    """The checks ``tandem train`` and ``tandem.fit`` run before launch: of the settings alone,
    against the plan (without torch), and of the class and its options."""
    from tandem.runtime.config import RunConfig
    from tandem.runtime.job import sketch_job
    from tandem.runtime.learning_rate import check_run_optimizer

    settings, message = REFUSED[case]
    settings = dict(settings)
    flags = settings.pop("flags", {})
    with pytest.raises(UsageError) as caught:
        run = RunConfig(model="mlp", data="digits", **settings)
        sketch_job("dp", flags, run)
        check_run_optimizer(run, None, build_model("mlp", build_dataset("digits").info),
                            stale=False)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.multiprocess
def test_the_command_line_says_it_in_one_line_with_status_2() -> None:
    for flags, message in ((("--optimizer", "adamx"), REFUSED["close name"][1]),
                           (("--optimizer", "adamw", "--optimizer-options", "beta=0.9,0.95"),
                            REFUSED["unknown option"][1])):
        result = run_here("train", "--model", "mlp", "--data", "digits", "--steps", "2",
                          "--no-progress", *flags)
        assert result.returncode == 2 and result.stdout == "", result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tandem train: error: "), lines
        assert message in lines[0], lines[0]


def _every(model: nn.Module) -> Any:
    return [{"params": list(model.parameters())}]


def _with_beta(model: nn.Module) -> Any:
    return [{"params": list(model.parameters()), "betas": (0.8, 0.99)}]


FIT_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "groups with lamb": ({"optimizer": "lamb", "param_groups": _every},
                         "param_groups with --optimizer lamb: lamb makes its own groups"),
    "groups and --no-decay": ({"param_groups": _every, "no_decay": "bias"},
                              "--no-decay bias and param_groups both make the parameter groups"),
    "a scheduler and warm-up": ({"scheduler": halving, "warmup_steps": 2},
                                "scheduler= replaces tandem's learning-rate schedule, of which "
                                "--warmup-steps 2 is a part"),
    "a scheduler on async servers": ({"scheduler": halving, "strategy": "ps", "servers": 1,
                                      "mode": "async", "nproc": 3},
                                     "scheduler= with --strategy ps --mode async: its servers "
                                     "and workers keep clocks of their own"),
    "a group's own beta, compensated": ({"param_groups": _with_beta, "optimizer": "adam",
                                         "strategy": "ps", "servers": 1, "mode": "async",
                                         "nproc": 3},
                                        "group 0 sets its own betas, and this run's stale "
                                        "updates are compensated by one momentum"),
    "an option AdamW does not take": ({"optimizer": "adamw", "param_groups": lambda m: [
        {"params": list(m.parameters()), "momentum": 0.9}]},
        "param_groups(model): group 0 sets 'momentum': AdamW takes no such option"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", FIT_REFUSED)
def test_fit_refuses_what_cannot_apply_in_one_line(case: str, tmp_path: Path) -> None:
    kwargs, message = FIT_REFUSED[case]
    if case == "an option AdamW does not take":  # a lambda: checked before the pickling
        from tandem.runtime.config import RunConfig
        from tandem.runtime.learning_rate import check_run_optimizer

        with pytest.raises(UsageError) as caught:
            check_run_optimizer(RunConfig(optimizer="adamw"), types.SimpleNamespace(
                param_groups=kwargs["param_groups"]), Tied(), stale=False)
    else:
        with pytest.raises(UsageError) as caught:
            tandem.fit("mlp", data="digits", steps=2, out=tmp_path, **kwargs)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.pure
def test_options_come_from_the_config_file_too(tmp_path: Path) -> None:
    """``optimizer-options`` as a mapping, a list of words or one line of them."""
    from tandem.cli import build_parser
    from tandem.commands.config_file import expand_config
    from tandem.runtime.config import RunConfig

    parser = build_parser("train").commands["train"]
    for text in ("optimizer-options: {betas: [0.9, 0.95], eps: 1.0e-8}\n",
                 "optimizer_options:\n  - betas=0.9,0.95\n  - eps=1e-8\n",
                 "optimizer-options: betas=0.9,0.95 eps=1e-8\n"):
        (tmp_path / "run.yaml").write_text(f"optimizer: AdamW\nno-decay: norm,bias\n{text}")
        args = parser.parse_args(expand_config(parser, ["--config", str(tmp_path / "run.yaml")]))
        config = RunConfig(optimizer=args.optimizer, optimizer_options=args.optimizer_options,
                           no_decay=args.no_decay)
        assert (config.optimizer, config.optimizer_options, config.no_decay) == (
            "adamw", {"betas": (0.9, 0.95), "eps": 1e-8}, "norm,bias"), text


@pytest.mark.pure
def test_compensation_reads_the_optimizers_own_momentum() -> None:
    """Asynchrony compensates an optimizer's ``beta1`` or ``momentum`` as given; where nothing
    is compensated, a resumed optimizer's groups get back their own."""
    from tandem.runtime.asynchrony import apply_compensation, compensation, restore_momentum
    from tandem.runtime.config import RunConfig
    from tandem.runtime.optimizer_class import momentum_coefficient

    cases = {("adamw", "betas=0.8,0.99"): (0.8, False), ("nadam", ""): (0.9, False),
             ("rmsprop", "momentum=0.5"): (0.5, True), ("adagrad", ""): (0.0, True),
             ("sgd", ""): (0.9, True)}
    for (name, options), expected in cases.items():
        config = RunConfig(optimizer=name, optimizer_options=options.split())
        assert momentum_coefficient(config) == expected, name
    param = nn.Parameter(torch.zeros(2))
    adam = torch.optim.Adam([{"params": [param]}, {"params": [], "betas": (0.5, 0.9)}])
    comp = apply_compensation(adam, compensation("auto", 0.9, 0, heavy_ball=False))
    adam.load_state_dict({**adam.state_dict(), "param_groups": [
        {**group, "betas": (0.1, 0.2)} for group in adam.state_dict()["param_groups"]]})
    restore_momentum(adam, comp)
    assert [group["betas"][0] for group in adam.param_groups] == [0.9, 0.5]
