"""Make ``import torchvision`` work on a CPU-only torch.

The only torchvision wheel matching torch 2.13 is a CUDA build whose compiled extension cannot load against
the CPU torch (``RuntimeError: operator torchvision::nms does not exist``); open_clip and timm import it. The
repair (ENVIRONMENT.md): drop the half-imported modules, register the two missing operator schemas with a
``torch.library.Library("torchvision", "DEF")`` kept alive, import again; only the compiled detection ops
(which CLIP never calls) stay unavailable. :func:`install` applies it lazily, on the first import of
torchvision, through a meta-path finder; the environment's ``.pth`` start-up hook calls it too.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

_MISSING_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_state: dict[str, Any] = {"library": None, "repaired": False}


def import_torchvision() -> ModuleType:
    """Import torchvision, registering the missing operator schemas if needed."""
    try:
        import torchvision
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        import torch

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # the half-imported modules
        if _state["library"] is None:
            library = torch.library.Library("torchvision", "DEF")
            for schema in _MISSING_OPS:
                library.define(schema)
            _state["library"] = library  # must outlive every use of torchvision
        _state["repaired"] = True
        import torchvision
    return torchvision


class _ExistingModuleLoader(importlib.abc.Loader):
    """Hands the import system a module that :func:`import_torchvision` already loaded."""

    def __init__(self, module: ModuleType) -> None:
        self._module, self._original_spec = module, module.__spec__

    def create_module(self, spec: Any) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._original_spec  # the import system overwrote it with ours


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torchvision":
            return None
        uninstall()
        module = import_torchvision()
        spec = importlib.util.spec_from_loader(fullname, _ExistingModuleLoader(module), is_package=True)
        spec.submodule_search_locations = list(module.__path__)  # type: ignore[union-attr]
        return spec


_finder = _TorchvisionFinder()


def install() -> None:
    """Repair torchvision lazily, on its first import, in this process."""
    if "torchvision" in sys.modules or _finder in sys.meta_path:
        return
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def was_repaired() -> bool:
    return bool(_state["repaired"])
