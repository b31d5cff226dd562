"""Build the C++ extension `memo_ext._C` from csrc/ (pybind11). Metadata lives in pyproject.toml."""
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "memo_ext._C",
            sorted(glob("csrc/*.cpp")),
            cxx_std=17,
            extra_compile_args=["-O3"],
            depends=sorted(glob("csrc/*.h")),
        )
    ],
    cmdclass={"build_ext": build_ext},
)
