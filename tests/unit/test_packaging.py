"""Our Triton kernels import as `dsv4_kernels` and never shadow (or get shadowed by) PyPI `kernels`."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_kernels_folder_is_not_an_importable_kernels_package():
    assert not (REPO / "kernels" / "__init__.py").exists()
    assert (REPO / "kernels" / "dsv4_kernels" / "__init__.py").is_file()


def test_no_shadowing_even_with_the_repo_root_on_sys_path():
    # `python -c` from the repo root puts the root first on sys.path: the worst case for shadowing
    code = (
        "import importlib.util, dsv4_kernels\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "regular = spec is not None and spec.origin not in (None, 'namespace')\n"
        "print('dsv4_kernels', dsv4_kernels.__file__)\n"
        "print('kernels-regular', regular, spec.origin if regular else None)\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print('transformers-sees-kernels', is_kernels_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["dsv4_kernels"].startswith(str(REPO / "kernels" / "dsv4_kernels"))
    regular, _, origin = lines["kernels-regular"].partition(" ")
    if regular == "True":  # only a real installed `kernels` distribution may answer to that name
        assert not origin.startswith(str(REPO)), origin
    installed = subprocess.run([sys.executable, "-m", "pip", "show", "kernels"], capture_output=True).returncode == 0
    assert lines["transformers-sees-kernels"] == str(installed)
