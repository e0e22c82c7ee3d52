"""Shared setup of the verl adapter tests (``test_verl*.py``): importing verl with its
missing heavy dependencies stubbed, and models patched by verl's fused-kernel hook.

``import verl`` imports Ray (through ``verl.protocol``) and verl's FSDP engine module
imports PEFT at its top; neither is used on the paths tested here. As the other adapter
tests stub their trainers' heavy imports, each missing one is a stub module only while
verl is imported, then leaves ``sys.modules`` (other test files see them missing). verl's
``torch`` backend replaces the model class's forward; :func:`load_verl` puts the class
forwards back when its generator closes, so other test files see stock transformers.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from unittest.mock import MagicMock

import torch
from _hf_models import ARCHS, tiny_model

import lp_hf.verl as lp_verl
from lp_testing import import_trainer


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the imports of ``roots`` (and their submodules) with ``MagicMock`` modules."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = MagicMock()
        module.__spec__, module.__name__, module.__path__ = spec, spec.name, []
        return module

    def exec_module(self, module) -> None:
        pass


@contextlib.contextmanager
def stubbed(*names: str) -> Iterator[None]:
    """Within the block, each of ``names`` that is not installed imports as a stub module."""
    missing = tuple(
        n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None
    )
    finder = _StubFinder(missing)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if m.split(".")[0] in missing]:
            del sys.modules[name]


def load_verl(engine: bool = False) -> Iterator[types.SimpleNamespace]:
    """Generator for a module-scoped fixture: verl's ``monkey_patch`` and ``core_algos``
    (with ``engine``, also its FSDP engine module, ``losses``, ``tensordict_utils`` and
    ``config``); skips when verl is missing. On close: verl's own fused-kernel hook and
    engine step, and the tiny models' class forwards, are restored."""
    with stubbed("ray", "peft"):
        import_trainer("verl")
        from verl.models.transformers import monkey_patch
        from verl.trainer.ppo import core_algos

        found = dict(monkey_patch=monkey_patch, core_algos=core_algos)
        if engine:
            from verl.utils import tensordict_utils
            from verl.workers import config
            from verl.workers.engine.fsdp import transformer_impl
            from verl.workers.utils import losses

            found.update(engine=transformer_impl, losses=losses, tu=tensordict_utils, config=config)
    classes = [ARCHS[arch][1] for arch in ("llama", "qwen2")]
    forwards = {cls: cls.__dict__["forward"] for cls in classes}
    hook = monkey_patch.patch_forward_with_backends
    yield types.SimpleNamespace(**found)
    lp_verl.remove_lp()
    monkey_patch.patch_forward_with_backends = hook
    for cls, forward in forwards.items():
        cls.forward = forward


def patched(verl, backend: str, arch: str, tied: bool, **model: object) -> torch.nn.Module:
    """A tiny model given verl's fused forward of ``backend`` (``"torch"`` or ``"lp"``)."""
    model = tiny_model(arch, tied=tied, **model)
    lp_verl.use_lp()  # idempotent: the entry point already registered it at `import verl`
    verl.monkey_patch.patch_forward_with_backends(
        model, use_fused_kernels=True, fused_kernels_backend=backend
    )
    return model
