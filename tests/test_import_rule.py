"""Spec and planning modules never import torch.distributed (checked in a clean subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

MODULES = ["tandem.cluster", "tandem.profile", "tandem.plan", "tandem.planning",
           "tandem.planning.antichain", "tandem.planning.levels", "tandem.planning.partition",
           "tandem.planning.planner"]  # fmt: skip
SCHEDULE_MODULES = ["tandem.schedule", "tandem.schedule.action", "tandem.schedule.schedule",
                    "tandem.schedule.generators", "tandem.schedule.check"]  # fmt: skip


def test_planning_imports_no_torch_distributed() -> None:
    script = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch.distributed" or name.startswith("torch.distributed."):
                    raise ImportError("blocked: " + name)
                return None
        sys.meta_path.insert(0, Block())
        for name in {MODULES!r}:
            importlib.import_module(name)
        assert not any(m.startswith("torch.distributed") for m in sys.modules), "leaked"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_schedule_imports_no_torch() -> None:
    """Schedules are pure Python: not even ``torch`` itself."""
    script = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("blocked: " + name)
                return None
        sys.meta_path.insert(0, Block())
        for name in {SCHEDULE_MODULES!r}:
            importlib.import_module(name)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
