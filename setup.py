"""Wires the cffi build of the C core (native/build_ffi.py) into the package
build; everything else is declared in pyproject.toml."""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["tract_cli", "tract_cli.*"]),
    cffi_modules=["native/build_ffi.py:ffibuilder"],
)
