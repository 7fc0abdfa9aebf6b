"""A trainer's model as its checkpoint: the tensors `save_pretrained` would
write, under the checkpoint's names, which is what wsync publishes and what
an inference engine's loader reads.

Transformers 5 holds some weights in another form than its checkpoints (a
layer's experts fused into one tensor, renamed modules) and converts both
ways with its own rules (``revert_weight_conversion``, what
``save_pretrained`` runs): :func:`checkpoint_tensors` applies those rules, so
no model family is described here. The checkpoint tensors that are views of
the model's parameters are published in place; the others (an expert cut
out of a fused tensor by a copy) are kept in buffers that
:meth:`CheckpointTensors.refresh` fills from the parameters before each
publish. A model without conversions (transformers 4, most dense models)
is its own state dict.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping

import torch

__all__ = ["CheckpointTensors", "checkpoint_tensors"]


@dataclass
class CheckpointTensors:
    """`tensors`: the checkpoint's tensors by name; views of the model's
    parameters, or buffers (`copied`, filled by refresh)."""
    tensors: Dict[str, torch.Tensor]
    copied: List[str] = field(default_factory=list)
    _convert: Callable[[], Mapping[str, torch.Tensor]] = lambda: {}

    def refresh(self) -> None:
        """Copies the current values of the tensors that are not views."""
        if not self.copied:
            return
        with torch.no_grad():
            fresh = self._convert()
            for name in self.copied:
                self.tensors[name].copy_(fresh[name])


def _revert(module: torch.nn.Module) -> Callable[[Mapping[str, torch.Tensor]], Dict[str, torch.Tensor]]:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the state dict is the checkpoint's
        return dict
    return lambda named: dict(revert_weight_conversion(module, dict(named)))


def checkpoint_tensors(module: torch.nn.Module) -> CheckpointTensors:
    """The checkpoint's tensors of a transformers model: its state dict
    (persistent buffers included, tied weights once, under the name its
    checkpoint keeps), converted. Views of the model's tensors where the
    conversion gives views, else buffers of the same shape and dtype."""
    # The state dict's tensors themselves (parameters, and persistent buffers
    # such as a router's bias correction), each once (a tied weight under its
    # first name): what the client moves into shared memory is the module's
    # own tensor (or a view whose base is one), so that it stays the
    # optimizer's.
    named, seen = {}, set()
    for n, t in module.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape)) if t.numel() else (n,)
        if key not in seen:
            seen.add(key)
            named[n] = t
    revert = _revert(module)
    with torch.no_grad():
        converted = revert(named)
    storages = {p.untyped_storage().data_ptr(): n for n, p in named.items() if p.numel()}
    views, copied, sources = {}, [], set()
    for name, t in converted.items():
        owner = storages.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if owner is not None:
            views[name] = t
        else:
            views[name] = t.detach().clone()
            copied.append(name)
    if copied:
        # The parameters the copies come from: those no view is of.
        viewed = {t.untyped_storage().data_ptr() for n, t in views.items() if n not in copied}
        sources = {n for n, p in named.items() if p.untyped_storage().data_ptr() not in viewed}

    def convert() -> Mapping[str, torch.Tensor]:
        return revert({n: t.detach() for n, t in named.items() if n in sources})
    return CheckpointTensors(views, copied, convert)
