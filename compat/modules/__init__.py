"""Reusable nn building blocks of the compatibility methods: projections, visual prompts, tied adapters, LoRA,
heads for serving, augmentation. Every insertion returns a handle whose ``remove()`` restores the original
module tree exactly. Submodules import torch at import time.
"""
