"""Reusable nn building blocks for the compatibility methods.

- :mod:`compat.modules.projection`: XBT's projection ``phi`` and TaCA's two-layer dimension projector.
- :mod:`compat.modules.visual_prompts`: learnable prompt tokens inserted into open_clip's VisionTransformer.
- :mod:`compat.modules.adapters`: tied-weight bottleneck adapters in every block of a vision transformer.
- :mod:`compat.modules.lora`: removable peft LoRA on open_clip towers that never touches the base weights.
- :mod:`compat.modules.serving`: an open_clip model served through heads; the adapter-free state dict.
- :mod:`compat.modules.augment`: XBT's image augmentation on preprocessed batches.

Every insertion returns a handle whose ``remove()`` restores the original module tree exactly.
Submodules import torch at import time; import them inside functions from CLI-facing code.
"""
