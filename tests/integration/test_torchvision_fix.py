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


def _bare_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a process without the environment's start-up hooks (``-S``: no .pth files run)."""
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": ":".join(p for p in sys.path if p)},
    )


def test_importing_the_library_changes_nothing_in_the_process():
    result = _bare_python(
        "import sys, compat, compat.models, compat.methods; "
        "print(any(type(f).__name__ == '_TorchvisionFinder' for f in sys.meta_path))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_program_start_repairs_torchvision():
    result = _bare_python(
        "from compat import _torchvision_fix as f; f.install(); import torchvision, torch; "
        "print(f.was_repaired() or hasattr(torch.ops.torchvision, 'nms'))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
