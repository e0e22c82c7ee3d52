"""skyrl-train 0.3 for the lp_hf.skyrl tests: its modules imported on CPU, a tiny
``HFModelWrapper`` and a rollout in SkyRL's layout.

skyrl-train's modules import Ray, flash-attn, peft (and, for the workers, its HTTP
endpoint's requests / fastapi / uvicorn) at import time. They are stubbed in
``sys.modules`` only while ``skyrl_train`` is imported (and removed again, so other test
files see the real ones or none): Ray reports itself not initialized, flash-attn's padding
helpers get working torch stand-ins (sample packing runs), peft is a stub (no LoRA here).
The HTTP packages are stubbed only where they are not installed.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from unittest.mock import MagicMock

import torch
from _hf_models import tiny_model

from lp_testing import import_trainer

NUM_ACTIONS = 5
_STUBBED = (
    "ray",
    "ray.util",
    "ray.util.placement_group",
    "flash_attn",
    "flash_attn.bert_padding",
    "peft",
    "peft.tuners",
    "peft.tuners.lora",
)
_IF_MISSING = (  # the worker module's imports, stubbed when not installed
    "ray.actor",
    "requests",
    "fastapi",
    "fastapi.middleware",
    "fastapi.middleware.cors",
    "fastapi.responses",
    "uvicorn",
)


def _stub(name: str) -> types.ModuleType:
    if name == "flash_attn.bert_padding":
        from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input

        module = types.ModuleType(name)
        module.unpad_input, module.pad_input = _unpad_input, _pad_input
    else:
        module = MagicMock()
        module.is_initialized = lambda: False  # ray: no registry actor is looked up
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


def _missing(name: str, stubbed: set[str]) -> bool:
    parent = name.rpartition(".")[0]
    if parent:
        return parent in stubbed
    return importlib.util.find_spec(name) is None


def import_skyrl(**modules: str) -> types.SimpleNamespace:
    """``skyrl_train`` modules imported with the stubs above, by attribute name:
    ``import_skyrl(ppo_utils="skyrl_train.utils.ppo_utils")`` (skips without skyrl-train)."""
    import_trainer("skyrl_train")
    inserted = [name for name in _STUBBED if name not in sys.modules]
    sys.modules.update({name: _stub(name) for name in inserted})
    stubbed = set(inserted)
    for name in _IF_MISSING:
        if name not in sys.modules and _missing(name, stubbed):
            sys.modules[name] = _stub(name)
            stubbed.add(name)
            inserted.append(name)
    try:
        loaded = {key: importlib.import_module(path) for key, path in modules.items()}
    finally:
        for name in inserted:
            del sys.modules[name]
    return types.SimpleNamespace(**loaded)


def make_wrapper(sky, arch: str = "llama", *, tied: bool = False, packing: bool = False):
    """A skyrl-train ``HFModelWrapper`` of a tiny random model (``sky.model_wrapper``)."""
    model = tiny_model(arch, tied=tied)
    model.config.use_cache = False  # as the wrapper's own constructor sets from a path
    # sample packing asks for flash_attention_2 by name; the tiny model runs sdpa, which
    # keeps packed sequences apart from their restarting position ids
    return sky.model_wrapper.HFModelWrapper(
        model, use_flash_attention_2=packing, use_sample_packing=packing
    )


def rollout(vocab: int, seed: int = 3):
    """SkyRL's layout: left-padded prompts (6) then right-padded responses (NUM_ACTIONS)."""
    g = torch.Generator().manual_seed(seed)
    b, p = 3, 6
    sequences = torch.randint(1, vocab, (b, p + NUM_ACTIONS), generator=g)
    attention_mask = torch.ones(b, p + NUM_ACTIONS, dtype=torch.long)
    attention_mask[1, :2] = 0
    attention_mask[2, :4] = 0
    attention_mask[0, -2:] = 0
    sequences[attention_mask == 0] = 0
    loss_mask = attention_mask[:, -NUM_ACTIONS:].float()
    return sequences, attention_mask, loss_mask
