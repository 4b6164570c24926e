"""compat: the library behind compatflow.

Models, data, losses, compatibility methods, metrics and backfill policies, in
pure PyTorch + open_clip + peft, with no orchestration imports. Importing this
package is cheap: heavy libraries are imported inside the functions that use them.
"""

from compat import _torchvision_fix

_torchvision_fix.install()

__version__ = "0.1.0"
