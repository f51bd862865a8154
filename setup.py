"""Build the ``tiercache`` package (metadata lives in pyproject.toml) and its optional C extensions.

The design's top-level folders ``adapters/``, ``serde/`` and ``gpu/`` are the package's subpackages through
relative symlinks committed in git (``tiercache/adapters -> ../adapters``, ...): every module has one real
path under ``tiercache/``, which Python, mypy and import-graph tools all follow, and a second checkout
imports its own folders (no package-dir mapping that an editable install would resolve to another checkout).
"""

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

PACKAGES = find_packages(include=["tiercache", "tiercache.*"])  # follows the symlinked subpackages

# The CPU row-copy kernel: plain C loaded with ctypes (no Python headers needed), threaded with OpenMP (it
# binds to torch's libgomp at load time: one worker pool for torch and the copies); optional, so an install
# without a C compiler still succeeds and the torch reference path runs instead.
ROWCOPY = Extension(
    "tiercache.gpu._rowcopy",
    sources=["gpu/_rowcopy.c"],
    extra_compile_args=["-O2", "-pthread", "-fopenmp"],
    extra_link_args=["-pthread", "-fopenmp"],
    optional=True,
)

# Kernel launches through the CUDA driver with parameters packed once (tiercache.gpu.launch); optional too:
# without it bound launches call Triton's launcher. It opens libcuda at run time (no CUDA headers needed).
LAUNCH = Extension(
    "tiercache.gpu._launch",
    sources=["gpu/_launch.c"],
    extra_compile_args=["-O2"],
    libraries=["dl"],
    optional=True,
)


class BuildOptionalExt(build_ext):
    """build_ext that leaves an optional extension which failed to build out of its outputs, so that an
    editable install (which links every listed output) succeeds without it, as a regular install does."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # the compiler's and linker's errors; a required extension still fails
            if not ext.optional:
                raise
            self.warn(f"{ext.name} was not built ({e}); tiercache runs its Python fallback instead")
            self.extensions = [x for x in self.extensions if x is not ext]


setup(
    packages=PACKAGES,
    ext_modules=[ROWCOPY, LAUNCH],
    cmdclass={"build_ext": BuildOptionalExt},
)
