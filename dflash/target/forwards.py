"""Replacing some of a target's modules' forwards for a while: the static decoder and the tap runner run the MLP and
RMSNorm modules through ``torch.compile`` (one fused kernel instead of a chain of elementwise ones: a small target's
forward is ~1,500 operators issued one by one), and the decoder runs the attention modules through its fused forward.

A replacement is an instance attribute ``module.forward`` over the class's own; deleting it gives the class's forward
back. Modules that already carry an instance forward (someone else's replacement) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["own_forward", "replace_forwards", "is_mlp_or_norm", "restore_forwards"]


def own_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s class forward, in a frame of its own: ``torch.compile(own_forward, dynamic=True)`` is one
    shape-generic graph per module class, whatever the module instance."""
    return type(module).forward(module, *args, **kwargs)


def is_mlp_or_norm(module: torch.nn.Module) -> bool:
    """The modules that touch no KV cache and are chains of elementwise kernels around at most a few GEMMs."""
    return type(module).__name__.endswith(("MLP", "RMSNorm"))


def replace_forwards(root: torch.nn.Module, selected: Callable[[torch.nn.Module], bool],
                     forward_for: Callable[[torch.nn.Module], Callable[..., Any]]) -> list[torch.nn.Module]:
    """Give every module under ``root`` (itself included) that ``selected`` picks and that has no instance forward
    yet the forward ``forward_for(module)`` (called before the replacement: ``module.forward`` is still its own
    there). Returns the modules replaced, for :func:`restore_forwards`."""
    replaced = []
    for module in root.modules():
        if selected(module) and "forward" not in vars(module):
            module.forward = forward_for(module)
            replaced.append(module)
    return replaced


def restore_forwards(modules: Iterable[torch.nn.Module]) -> None:
    """The class's own forward again for each module :func:`replace_forwards` returned."""
    for module in modules:
        del module.forward
