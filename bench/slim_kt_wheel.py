"""A kt-kernel wheel cut to what --moe-backend hybrid imports, to carry to a lent GPU (the device tool carries
at most 64 MiB; the PyPI wheel is 101 MB, most of it sgl_kernel, deep_gemm and mscclpp, which kt_kernel never
imports). Keeps kt_kernel/ (without its CLI), its vendored libraries (kt_kernel.libs/: libnuma, libhwloc, ...)
and its metadata, with RECORD and top_level.txt cut to match; 13.7 MB for 0.7.2. The device image lacks gguf,
safetensors and pyyaml, which kt_kernel imports at load: download those wheels beside it.

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_35_x86_64 kt-kernel==0.7.2 -d /tmp/kt
    python bench/slim_kt_wheel.py /tmp/kt/kt_kernel-0.7.2-cp312-cp312-manylinux_2_35_x86_64.whl .whl/
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def keep(name: str) -> bool:
    return (name.startswith("kt_kernel/") and not name.startswith("kt_kernel/cli/")) or name.startswith(
        ("kt_kernel.libs/", "kt_kernel-")
    )


def slim(src: Path, out_dir: Path) -> Path:
    dst = out_dir / src.name
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if not keep(info.filename):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(f"{ln}\n" for ln in data.decode().splitlines() if keep(ln)).encode()
            elif info.filename.endswith(".dist-info/top_level.txt"):
                data = b"kt_kernel\n"
            zout.writestr(info, data)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out = slim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB")
