"""Map the card's top-level folders into the ``tiercache`` namespace (metadata lives in pyproject.toml)."""

from setuptools import find_packages, setup

ROOTS = {
    "tiercache": "tiercache",
    "tiercache.adapters": "adapters",
    "tiercache.serde": "serde",
    "tiercache.gpu": "gpu",
}
PACKAGES = [p for pkg, src in ROOTS.items() for p in (pkg, *(f"{pkg}.{s}" for s in find_packages(src)))]

setup(package_dir=ROOTS, packages=PACKAGES)
