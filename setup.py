"""Build the small C extensions under ``bmoe/native/`` (everything else is in setup.cfg).

Each ``bmoe/native/<name>.c`` is one extension module, ``bmoe.native.<name>``: a few C
functions that llama.cpp calls on its own threads, where a Python callback would cost
too much or could not run at all. They include no llama.cpp header: the layouts they
read are handed to them by Python, which checks them against the loaded library first.
"""

from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).parent
NATIVE = sorted((HERE / "bmoe" / "native").glob("*.c"))

setup(ext_modules=[
    Extension(f"bmoe.native.{src.stem}", [str(src.relative_to(HERE))],
              extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
              libraries=["m"])
    for src in NATIVE
])
