"""Shared setup of the OpenRLHF adapter tests (``test_openrlhf*.py``): OpenRLHF's modules
imported on a CPU machine without its GPU and cluster dependencies, tiny actors and a
rollout in OpenRLHF's layout.

OpenRLHF's modules import DeepSpeed, flash-attn, peft (and its trainer module ray, vLLM,
...) at import time. As OpenRLHF's own CPU test of ``Actor`` does, the missing ones are
stubbed in ``sys.modules`` only while OpenRLHF is imported (and removed again, so other
test files see the real ones or none), and ``torch.compile`` is the identity meanwhile
(its ``compute_entropy`` runs eagerly). flash-attn's padding helpers get working torch
stand-ins so that packed samples run; the collective (ring attention) stays a stub.
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
from _hf_models import tiny_model

from lp_testing import import_trainer

STUBBED = (
    "deepspeed",
    "flash_attn",
    "flash_attn.bert_padding",
    "flash_attn.utils",
    "flash_attn.utils.distributed",
    "peft",
    "peft.tuners",
    "peft.tuners.lora",
)
"""What ``openrlhf.models`` imports that a CPU test machine lacks."""
TRAINER_ROOTS = ("ray", "deepspeed", "peft", "flash_attn", "vllm", "torchdata", "PIL", "aiohttp")
"""Top-level packages ``openrlhf.trainer.ray.ppo_actor`` imports; stubbed when missing."""


def bert_padding() -> types.ModuleType:
    """Torch stand-ins of the flash_attn.bert_padding functions OpenRLHF's packing uses."""
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input

    def rearrange(tensor: torch.Tensor, pattern: str) -> torch.Tensor:
        assert pattern == "b s ... -> (b s) ...", pattern
        return tensor.reshape(-1, *tensor.shape[2:])

    module = types.ModuleType("flash_attn.bert_padding")
    module.unpad_input = _unpad_input
    module.pad_input = _pad_input
    module.index_first_axis = lambda tensor, indices: tensor[indices]
    module.rearrange = rearrange
    return module


@contextlib.contextmanager
def eager_compile() -> Iterator[None]:
    """``torch.compile`` is the identity inside (restored on exit)."""
    compile_ = torch.compile
    torch.compile = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    try:
        yield
    finally:
        torch.compile = compile_


def import_models() -> types.ModuleType:
    """``openrlhf.models``, imported with the stubs above (skips when OpenRLHF is missing)."""
    import_trainer("openrlhf")
    inserted = []
    for name in STUBBED:
        if name not in sys.modules:
            stub = bert_padding() if name == "flash_attn.bert_padding" else MagicMock()
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = stub
            inserted.append(name)
    try:
        with eager_compile():
            import openrlhf.models as models
    finally:
        for name in inserted:
            del sys.modules[name]
    return models


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports any module under ``roots`` as a MagicMock package."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = MagicMock()
        module.__spec__, module.__path__, module.__name__ = spec, [], spec.name
        return module

    def exec_module(self, module) -> None:
        pass


def import_ppo_actor(models: types.ModuleType) -> types.ModuleType:
    """``openrlhf.trainer.ray.ppo_actor`` (``ActorPPOTrainer``), its missing dependencies
    stubbed only during the import; ``models`` first (its working padding stand-ins)."""
    del models
    missing = tuple(
        root
        for root in TRAINER_ROOTS
        if root not in sys.modules and importlib.util.find_spec(root) is None
    )
    finder = StubFinder(missing)
    before = set(sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        with eager_compile():
            import openrlhf.trainer.ray.ppo_actor as ppo_actor
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if name.split(".")[0] in missing:
                del sys.modules[name]
        forget_availability()
    return ppo_actor


def forget_availability() -> None:
    """Clear the cached ``is_*_available()`` answers of transformers and accelerate, which
    saw the stubs as installed packages (they are asked again, and answer the truth)."""
    for name in ("transformers.utils.import_utils", "accelerate.utils.imports"):
        for fn in vars(sys.modules.get(name, types.ModuleType(name))).values():
            if callable(getattr(fn, "cache_clear", None)):
                fn.cache_clear()


def make_actor(models, arch: str = "llama", *, tied: bool = False, temperature: float = 1.0, **kw):
    """A tiny ``Actor`` around a random model, ``packing_samples`` False."""
    model = tiny_model(arch, tied=tied, **kw)
    # what Actor's own constructor does from a path (Actor(model) leaves both as they are);
    # without use_cache=False transformers does not keep packed sequences apart in sdpa
    model.config.use_cache = False
    actor = models.Actor(model, temperature=temperature)
    actor.packing_samples = False
    return actor


def rollout(vocab: int, seed: int = 3):
    """OpenRLHF's layout: left-padded prompts (6) then right-padded responses (5)."""
    g = torch.Generator().manual_seed(seed)
    b, p, a = 3, 6, 5
    sequences = torch.randint(0, vocab, (b, p + a), generator=g)
    attention_mask = torch.ones(b, p + a, dtype=torch.long)
    attention_mask[1, :2] = 0  # prompt padding
    attention_mask[2, :4] = 0
    attention_mask[0, -2:] = 0  # response padding after EOS
    sequences[attention_mask == 0] = 0  # pad id
    action_mask = attention_mask[:, -a:].bool()
    return sequences, attention_mask, action_mask
