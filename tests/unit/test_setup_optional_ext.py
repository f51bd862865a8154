"""setup.py: an optional C extension that fails to build is left out (its Python fallback runs) and the
build still succeeds, so an editable install, which links every listed output, works without it."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_broken_optional_extension_is_left_out_of_the_build(tmp_path: Path) -> None:
    tree = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(tree)) as tar:
        tar.extractall(tmp_path, filter="data")
    (tmp_path / "setup.py").write_bytes((REPO / "setup.py").read_bytes())  # the working tree's version
    launch_c = tmp_path / "gpu" / "_launch.c"
    launch_c.write_text(launch_c.read_text() + "\nthis is not C\n")
    run = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tiercache.gpu._launch was not built" in run.stderr
    built = sorted(p.name.split(".")[0] for p in (tmp_path / "gpu").glob("*.so"))
    assert built == ["_rowcopy"]
