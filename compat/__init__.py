"""compat: the library behind compatflow.

Models, data, losses, compatibility methods, metrics and backfill policies, in
pure PyTorch + open_clip + peft, with no orchestration imports. Importing this
package is cheap and changes nothing in the process: heavy libraries are imported inside the
functions that use them. Programs start by installing the torchvision repair
(:func:`compat._torchvision_fix.install`): the environment's ``.pth`` start-up hook does it, and so
does the ``compatflow`` command.
"""

__version__ = "0.1.0"
