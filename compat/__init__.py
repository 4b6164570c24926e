"""compat: the library behind compatflow (models, data, losses, compatibility methods, metrics, backfill), in
PyTorch + open_clip + peft with no orchestration imports. Importing it is cheap and changes nothing in the
process; programs install the torchvision repair first (:func:`compat._torchvision_fix.install`).
"""

__version__ = "0.1.0"
