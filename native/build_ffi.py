"""cffi build script for the TraCT C core (API mode, out-of-line).

`pip install .` runs this through setuptools' `cffi_modules`, producing
`tract_cli._native`; importing the package never compiles anything.  The
cdef is read from native/tract.h and native/format.h (the blocks between
CDEF-BEGIN and CDEF-END), so the declarations cffi sees and the headers the
C sources include cannot drift apart.
"""
import os
import pathlib

from cffi import FFI

NATIVE = pathlib.Path(__file__).resolve().parent
# every C file of native/ is part of the core (a test's C lives in tests/):
# a glob, so a new file cannot be left out of the build
SOURCES = sorted(p.name for p in NATIVE.glob("*.c"))


def read_cdef() -> str:
    """Returns the cffi-parsable parts of format.h (on-media constants) and
    tract.h (the API): the blocks between a CDEF-BEGIN and a CDEF-END."""
    blocks = []
    for name in ("format.h", "tract.h"):
        text = (NATIVE / name).read_text()
        at = 0
        while (start := text.find("/* CDEF-BEGIN", at)) >= 0:
            start = text.index("*/", start) + 2
            end = text.index("/* CDEF-END */", start)
            blocks.append(text[start:end])
            at = end
    return "\n".join(blocks)


def asan() -> bool:
    """TRACT_ASAN=1: build under AddressSanitizer (tests/test_asan_fuzz.py; the
    process that loads it needs LD_PRELOAD of libasan)."""
    return os.environ.get("TRACT_ASAN") == "1"


def extra_compile_args() -> list[str]:
    """Strict warnings always; -Werror when TRACT_WERROR=1 (tests and CI).
    Hidden visibility: the core's functions are called only by the cffi
    wrapper built into the same object (Python's module init stays exported),
    so calls between the core's files are direct, not through the PLT."""
    args = ["-std=gnu11", "-O3", "-Wall", "-Wextra", "-fno-strict-aliasing",
            "-fvisibility=hidden"]
    if os.environ.get("TRACT_WERROR") == "1":
        args.append("-Werror")
    if asan():
        args += ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g"]
    return args


ffibuilder = FFI()
ffibuilder.cdef(read_cdef())
ffibuilder.set_source(
    "tract_cli._native",
    '#include "format.h"\n#include "tract.h"\n',
    # setuptools wants paths relative to the project root (the build's cwd)
    sources=[f"native/{name}" for name in SOURCES],
    include_dirs=["native"],
    extra_compile_args=extra_compile_args(),
    extra_link_args=["-fsanitize=address"] if asan() else [],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
