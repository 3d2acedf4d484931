"""The Python API: train your own model, data and loss with any strategy, from a script.

``fit`` takes objects — any ``nn.Module`` (or a function that builds one), any map-style or
iterable ``Dataset`` of ``(input, target)`` pairs, any loss ``loss(output, targets)`` returning
the batch's mean — and a plan (a strategy with its options, or a ``Plan`` from ``tandem plan``
or ``tandem search``). It runs the same job ``tandem train`` runs: on ``nproc`` local worker
processes, or, inside a ``torchrun`` job, as this process's worker. Objects travel to spawned
workers by pickle, so define their classes and functions at the top level of a module and call
``fit`` under ``if __name__ == "__main__":``.

Usage::

    import tandem

    result = tandem.fit(MyNet(), train_set, test_set, loss=my_loss, strategy="ps",
                        servers=1, mode="sync", nproc=3, steps=200, batch_size=64, lr=0.05)
    print(result.summary["test_accuracy"])
    result.model            # MyNet with the trained parameters and buffers
"""

from __future__ import annotations

import dataclasses
import difflib
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.callbacks import Callback, StepInfo

__all__ = ["Callback", "FitResult", "StepInfo", "fit"]


@dataclasses.dataclass(frozen=True, slots=True)
class FitResult:
    """What :func:`fit` returns on the process that ran rank 0 (elsewhere under torchrun, a
    result with an empty summary and no model)."""

    summary: dict[str, Any]
    """The run's summary: ``test_accuracy``, ``test_loss``, ``final_loss``, ``steps``, timings
    and the strategy's figures (the ``--json`` output of ``tandem train``)."""
    model: nn.Module | None
    """The trained model: the module given to :func:`fit` itself, updated in place, or a new
    one from the builder or spec; None where this process got no final state."""
    out: Path | None
    """The run's output directory (None when ``out`` was not given: a temporary one was used)."""


def fit(model: nn.Module | Callable[..., nn.Module] | str,
        train: Any = None, test: Any = None, *,
        loss: Callable[[Any, Any], torch.Tensor] | str | None = None,
        data: str | None = None, info: Any = None,
        strategy: str | None = None, plan: Plan | str | None = None,
        nproc: int | None = None, out: str | Path | None = None,
        param_groups: Callable[[nn.Module], Any] | None = None,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        callbacks: list[Any] | None = None,
        metrics: dict[str, Callable[[Any, Any], Any]] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        sampler: Any = None, loader_options: dict[str, Any] | None = None,
        **options: Any) -> FitResult:
    """Train ``model`` on ``train`` with a distributed plan; evaluate on ``test``.

    Args:
        model: an ``nn.Module`` (each worker trains a copy; the result is loaded back into it),
            a function returning one (called after seeding, with ``info=`` if it takes it), or
            a model spec as ``tandem train --model`` takes.
        train: the training ``Dataset`` of ``(input, target)`` pairs; None: ``data`` names it.
        test: the test ``Dataset`` (None with ``train``: the training data is scored, and the
            summary's ``scored_on`` says so).
        loss: ``loss(output, targets)`` returning the batch's mean loss as a scalar, or
            ``"package.module:function"``; None: cross-entropy on the model's logits.
        data: a dataset spec as ``tandem train --data`` takes (instead of ``train``/``test``).
        info: a :class:`tandem.data.DataInfo` for built-in models on your data (else inferred).
        strategy: ``dp``, ``ps``, ``gossip``, ``easgd``, ``localsgd`` or ``pipeline``
            (default ``dp``), with its options as keyword arguments named like its flags
            (``servers=1, mode="async"``, ``stages=2, schedule="gpipe"``, ``compress="fp16"``;
            tensor parallelism of your model: ``tensor_parallel=2, tensor_layers={"fc1":
            "colwise", "fc2": "rowwise"}``, see :mod:`tandem.models.tensor`; sharded data
            parallelism: ``shard=4, shard_level=3, shard_units=["encoder.0", "encoder.1"]``,
            see :mod:`tandem.sync.sharded`).
        plan: a :class:`tandem.plan.Plan` or the path of a ``plan.json`` (instead of
            ``strategy``); ``nproc`` defaults to its workers.
        nproc: local worker processes (default: the plan's, else 1; ignored under torchrun).
        out: directory for ``final.pt``, ``metrics.jsonl``, ``trace.json``, checkpoints
            (``log_to="tensorboard,csv,jsonl"`` picks the logs: see ``tandem train --log-to``).
        param_groups: ``param_groups(model)`` returns the optimizer's parameter groups as
            ``torch.optim`` takes them (``[{"params": decay}, {"params": rest,
            "weight_decay": 0.0}]``), over the whole model it is given; every strategy applies
            them to the parameters each worker holds (see :mod:`tandem.runtime.param_groups`).
        scheduler: ``scheduler(optimizer)`` returns a ``torch.optim.lr_scheduler`` scheduler
            over the optimizer it is given, stepped after every optimizer step instead of
            ``warmup_steps``/``lr_schedule``/``lr_scaling`` (synchronous strategies and
            pipelines; one line elsewhere).
        callbacks: objects with hooks ``on_step_end``, ``on_log``, ``on_evaluation`` and
            ``on_checkpoint`` (subclass :class:`tandem.Callback`), run in the workers, on rank 0
            unless ``every_rank`` (see :mod:`tandem.runtime.callbacks`).
        metrics: ``{name: metric(outputs, targets)}``, each a number computed on the whole
            evaluation's outputs and targets (gathered on rank 0), reported as ``test_<name>``
            in the summary, the metrics lines and the progress bar (see
            :mod:`tandem.runtime.user_metrics`).
        collate_fn: ``collate_fn(items)`` makes one batch of a list of ``train``'s (and
            ``test``'s) items, as ``DataLoader(collate_fn=...)`` does, and returns it as
            ``(inputs, targets)`` with one row per item (items may then be anything it takes,
            and batches may differ in shape: a padding collate). Every strategy uses it; the
            launching process collates a few items first, so one that fails is one line before
            any worker starts (:mod:`tandem.data.collate`). A ``--data`` function returns its
            own: ``(train, test, collate_fn)``.
        sampler: a ``torch.utils.data.Sampler`` (or iterable) of training-set indices that
            orders each epoch (a ``WeightedRandomSampler``, say); tandem still makes batches of
            ``batch_size`` from that order, splits each over the data-parallel workers and
            resumes exactly, so the sampler must give the same order whenever it is asked for
            the same epoch (tandem seeds torch's random state per epoch and calls
            ``set_epoch``; see :mod:`tandem.data.user_sampler`).
        loader_options: ``DataLoader`` options that apply to tandem's batches: ``num_workers``
            (``loader_workers``: processes reading batches ahead), ``prefetch_factor``,
            ``pin_memory`` (GPU runs), ``shuffle`` and ``drop_last``; any other is refused
            in one line (:mod:`tandem.spec.loader`).
        **options: the run's settings, named like ``tandem train``'s flags: ``steps``,
            ``batch_size``, ``optimizer`` (a name, ``"package.module:Class"``),
            ``optimizer_options`` (a dict: ``{"betas": (0.9, 0.95)}``), ``no_decay``
            (``"norm,bias"``), ``lr``, ``momentum``, ``seed``, ``precision``, ...;
            ``init_fn``, ``"reset"`` or a function ``init_fn(module)`` that initializes one
            module's own weights, builds a model given as a function on the meta device one
            module at a time (:mod:`tandem.models.pieces`).

    Raises:
        UsageError: a mistake in the arguments, data, model or loss (one line naming it).
        WorkerFailure: a worker failed or died (one line naming it).
    """
    from tandem.runtime.callbacks import check_callbacks
    from tandem.runtime.config import RunConfig, log_sinks
    from tandem.runtime.job import Job
    from tandem.runtime.launcher_env import under_launcher, world_size
    from tandem.runtime.main_guard import check_main_guard
    from tandem.runtime.run import make_job, run_training
    from tandem.runtime.task import UserObjects
    from tandem.runtime.user_metrics import check_metrics
    from tandem.spec.arguments import checked_type
    from tandem.strategy import PLAN_FLAGS, plan_with_flags

    if not under_launcher():
        check_main_guard()  # before the data and model are built: each worker would run it again
    for name, value, kind in (("strategy", strategy, "str"), ("data", data, "str"),
                              ("out", out, "path")):
        checked_type(name, value, kind, flag=f"--{name}", optional=True)
    if train is None and data is None:
        raise UsageError("fit() needs the training data: give train=<Dataset> or data=<spec>, "
                         "e.g. data='digits'")
    if train is not None and data is not None:
        raise UsageError("fit() got both train= and data=; give one of them")
    if test is not None and train is None:
        raise UsageError("fit() got test= without train=; give both datasets, or data=<spec>")
    if collate_fn is not None and train is None:
        raise UsageError("fit() got collate_fn= with data=; give the datasets (train=, test=) "
                         "with it, or return (train, test, collate_fn) from the data function")
    init_fn = options.pop("init_fn", None)
    if init_fn is not None and isinstance(model, nn.Module):
        raise UsageError(f"init_fn initializes a model that tandem builds, and the model given "
                         f"is already built ({type(model).__name__}); give the function that "
                         f"builds it (model=lambda: {type(model).__name__}(...)), or drop "
                         f"init_fn")
    objects = UserObjects(model=None if isinstance(model, str) else model, train=train,
                          test=test, loss=None if loss is None or isinstance(loss, str) else loss,
                          info=info, init_fn=None if isinstance(init_fn, str) else init_fn,
                          param_groups=param_groups, scheduler=scheduler,
                          callbacks=check_callbacks(callbacks),
                          metrics=check_metrics(metrics), collate_fn=collate_fn, sampler=sampler)
    settings, flags = _split_options(options, PLAN_FLAGS, RunConfig)
    settings.update(_loader_settings(loader_options, settings.get("loader_workers")))
    if init_fn is not None:
        settings["init_fn"] = init_fn if isinstance(init_fn, str) else _label(init_fn, "init_fn")
    settings.update(model=model if isinstance(model, str) else _label(model),
                    data=data if data is not None else _label(train, "dataset"),
                    loss=loss if isinstance(loss, str) else (None if loss is None
                                                             else _label(loss, "loss")),
                    progress=options.get("progress", False))
    files = [name for name in log_sinks(settings.get("log_to", "jsonl")) if name != "jsonl"]
    if files and out is None:
        raise UsageError(f"fit(log_to={','.join(files)!r}) writes its logs into out, and none is "
                         f"given (without it the run's files are removed when fit returns); "
                         f"give out=DIR")
    temporary = None
    if out is None:
        temporary = tempfile.TemporaryDirectory(prefix="tandem-fit-")
        settings["out"] = temporary.name
    else:
        settings["out"] = str(out)
    processes = world_size() if under_launcher() else nproc
    if not under_launcher():
        _check_picklable(objects)
    try:
        if plan is not None:
            source = str(plan) if not isinstance(plan, Plan) else "the plan given to fit()"
            loaded = Plan.load(str(plan)) if not isinstance(plan, Plan) else plan
            loaded = plan_with_flags(loaded, strategy, flags, source)
            job = Job(run=RunConfig(**settings, nproc=loaded.num_workers if processes is None
                                    else processes), plan=loaded, objects=objects)
        else:
            job = make_job(strategy or "dp", flags, objects=objects,
                           nproc=1 if processes is None else processes, **settings)
        summary = run_training(job)
        trained = _load_final(model, objects, job, Path(settings["out"]) / "final.pt")
    finally:
        if temporary is not None:
            temporary.cleanup()
    return FitResult(summary=summary or {}, model=trained,
                     out=None if out is None else Path(out))


def _split_options(options: dict[str, Any], plan_flags: tuple[str, ...],
                   run_config: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """``fit``'s keyword options: the run's settings and the plan's flags (``--servers``)."""
    fields = {field.name for field in dataclasses.fields(run_config)}
    fields -= {"model", "data", "loss", "out", "nproc", "loader_options"}
    aliases = {"timeout": "timeout_s"}
    flag_names = {flag.lstrip("-").replace("-", "_"): flag for flag in plan_flags}
    settings: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    for key, value in options.items():
        key = aliases.get(key, key)
        if key in fields:
            settings[key] = value
        elif key in flag_names:
            if value is not None and value is not False:
                flags[flag_names[key]] = _checked_flag(key, value, flag_names[key])
        else:
            known = sorted(fields | set(flag_names))
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
            raise UsageError(f"fit() got an unknown option {key!r}; {hint}")
    return settings, flags


def _loader_settings(loader_options: dict[str, Any] | None,
                     loader_workers: int | None) -> dict[str, Any]:
    """``fit``'s ``loader_options`` as run settings: ``num_workers`` is ``loader_workers``."""
    rest = dict(loader_options or {})
    if "num_workers" not in rest:
        return {"loader_options": rest}
    workers = rest.pop("num_workers")
    if loader_workers is not None and loader_workers != workers:
        raise UsageError(f"fit() got loader_workers={loader_workers} and loader option "
                         f"num_workers={workers}; give one of them")
    return {"loader_options": rest, "loader_workers": workers}


def _checked_flag(name: str, value: Any, flag: str) -> Any:
    """A plan option of ``fit`` (``servers=2``) of the type its flag parses to (a switch:
    ``True``), as the command line checks its words; one line if not."""
    from tandem.spec.arguments import checked_type
    from tandem.strategy import PLAN_FLAG_KINDS

    kind = PLAN_FLAG_KINDS.get(flag)
    return value if kind is None else checked_type(name, value, kind, flag=flag)


def _label(thing: Any, what: str = "model") -> str:
    """How the summary names an object (its class, or a function's qualified name). A model's
    builder is named as ``--model`` names one, ``module:function``: not a built-in model."""
    if isinstance(thing, (nn.Module, torch.utils.data.Dataset)) or not callable(thing):
        return f"{type(thing).__module__}.{type(thing).__qualname__}"
    join = ":" if what == "model" else "."
    return f"{getattr(thing, '__module__', '?')}{join}{getattr(thing, '__qualname__', what)}"


def _check_picklable(objects: Any) -> None:
    """Objects must reach spawned workers: refuse, in one line, one that does not pickle."""
    for field in ("model", "train", "test", "loss", "info", "param_groups", "scheduler",
                  "callbacks", "metrics", "collate_fn", "sampler"):
        value = getattr(objects, field)
        if value is None:
            continue
        try:
            pickle.dumps(value)
        except Exception as exc:  # any pickling failure: name the object and the way out
            lines = str(exc).strip().splitlines()
            raise UsageError(f"fit(): the {field} cannot be sent to the worker processes "
                             f"({type(exc).__name__}: {lines[0] if lines else ''}); define its "
                             f"class or function at the top level of a module (not in a "
                             f"function or a lambda)") from None


def _load_final(model: Any, objects: Any, job: Any, path: Path) -> nn.Module | None:
    """The trained model: ``final.pt`` loaded into the given module (in place), or into a new
    one from the builder or spec; None where this process has no ``final.pt``."""
    if not path.exists():
        return None
    from tandem.runtime.task import Task

    state = torch.load(path, map_location="cpu", weights_only=True)
    target = model if isinstance(model, nn.Module) else Task(job.run, objects).build_model()
    target.load_state_dict(state)
    return target
