"""Spec and planning modules never import torch.distributed (checked in a clean subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cli

MODULES = ["tandem.cluster", "tandem.profile", "tandem.plan", "tandem.planning",
           "tandem.planning.partition.antichain", "tandem.planning.partition.levels", "tandem.planning.partition.pipedream",
           "tandem.planning.search.planner", "tandem.timeline", "tandem.topology",
           "tandem.spec.codec", "tandem.planning.simulate.codecs", "tandem.planning.simulate.compare",
           "tandem.planning.partition.branches", "tandem.planning.partition.downsets"]  # fmt: skip
SCHEDULE_MODULES = ["tandem.schedule", "tandem.schedule.action", "tandem.schedule.schedule",
                    "tandem.schedule.generators", "tandem.schedule.check"]  # fmt: skip


def assert_imports_without(modules: list[str], blocked: str) -> None:
    """Import ``modules`` in a fresh interpreter where ``blocked`` (and its submodules) cannot be
    imported; fail with the interpreter's error if any of them needs it."""
    script = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == {blocked!r} or name.startswith({blocked!r} + "."):
                    raise ImportError("blocked: " + name)
                return None
        sys.meta_path.insert(0, Block())
        for name in {modules!r}:
            importlib.import_module(name)
        assert not any(m == {blocked!r} or m.startswith({blocked!r} + ".") for m in sys.modules)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_planning_imports_no_torch_distributed() -> None:
    assert_imports_without(MODULES, "torch.distributed")


def test_schedule_imports_no_torch() -> None:
    """Schedules are pure Python: not even ``torch`` itself."""
    assert_imports_without(SCHEDULE_MODULES, "torch")
