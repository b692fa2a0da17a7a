"""Wires the cffi build of the C core into the package build, and ships the
top-level profiles/ directory inside the package as tract_cli/profiles."""
import pathlib
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildWithProfiles(build_py):
    """build_py that also copies profiles/**/*.toml into the built package."""

    def run(self):
        super().run()
        src = pathlib.Path(__file__).resolve().parent / "profiles"
        dst = pathlib.Path(self.build_lib) / "tract_cli" / "profiles"
        for toml in src.rglob("*.toml"):
            target = dst / toml.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(toml, target)


setup(
    packages=find_packages(include=["tract_cli", "tract_cli.*"]),
    cffi_modules=["native/build_ffi.py:ffibuilder"],
    cmdclass={"build_py": BuildWithProfiles},
)
