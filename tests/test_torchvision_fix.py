"""open_clip imports in any process of the environment, on a CPU-only torch."""

import subprocess
import sys


def test_open_clip_imports_in_a_fresh_process():
    code = (
        "import open_clip, torchvision; from torchvision import transforms; print(torchvision.__spec__.name)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torchvision"


def test_repair_applies_through_the_compat_import_alone():
    code = (
        "import sys; "
        "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_TorchvisionFinder']; "
        "import compat, torchvision, torch; from compat import _torchvision_fix as f; "
        "print(f.was_repaired() or hasattr(torch.ops.torchvision, 'nms'))"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": ":".join(p for p in sys.path if p)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
