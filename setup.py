"""Build the C++ extension `memo_ext._C` from csrc/ (pybind11; torch's c10 headers and
libc10 for the errors its CUDA allocator hooks throw) and ship the CUDA stitching
allocator's sources in the package. Metadata lives in pyproject.toml."""
import importlib.util
import shutil
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

#: Where memo_ext.alloc.stitching_cuda finds its sources in an installed package.
STITCHING_CUDA_PACKAGE_DIR = Path("memo_ext", "alloc", "_csrc")


def _torch_build():
    """memo_ext/torch_build.py, loaded by path (the package is not importable yet): c10's
    headers and library, which the planned arena's allocator hooks throw PyTorch's
    out-of-memory error with (csrc/torch_errors.h). torch must be installed first, and the
    build must see it (pip --no-build-isolation; the Makefile does both)."""
    path = Path(__file__).parent / "memo_ext" / "torch_build.py"
    spec = importlib.util.spec_from_file_location("memo_torch_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TORCH_BUILD = _torch_build()


class BuildPyWithStitchingSources(build_py):
    """build_py, plus csrc/cuda/*.cpp and the csrc/*.h they include, copied into
    memo_ext/alloc/_csrc/ of the build. memo_ext.alloc.stitching_cuda compiles them on the
    machine that uses them (it needs that machine's CUDA toolkit, not the build machine's), so the
    wheel carries sources, not a library. The copy keeps csrc/'s layout, so the sources'
    relative includes resolve, and csrc/ stays the only copy in git."""

    def run(self):
        super().run()
        if self.editable_mode:  # an editable install compiles csrc/ of the checkout itself
            return
        target = Path(self.build_lib) / STITCHING_CUDA_PACKAGE_DIR
        for source in sorted(glob("csrc/cuda/*.cpp") + glob("csrc/*.h")):
            copy = target / Path(source).relative_to("csrc")
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy)


setup(
    ext_modules=[
        Pybind11Extension(
            "memo_ext._C",
            # csrc/allocator_models/: the allocator models, one header per policy
            sorted(glob("csrc/*.cpp") + glob("csrc/allocator_models/*.cpp")),
            cxx_std=17,
            extra_compile_args=["-O3", *TORCH_BUILD.compile_flags()],
            # libc10 next to the installed package's torch (a wheel), else where it was built
            extra_link_args=TORCH_BUILD.link_flags(origin_relative="../torch/lib"),
            depends=sorted(glob("csrc/*.h") + glob("csrc/allocator_models/*.h")),
        )
    ],
    cmdclass={"build_ext": build_ext, "build_py": BuildPyWithStitchingSources},
)
