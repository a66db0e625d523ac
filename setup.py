"""Build script for fp_recipes.

The CUDA extension ``fp_recipes._C`` is framework-agnostic C++/CUDA with pybind11 bindings. It needs
only ``nvcc`` (not a CUDA build of torch), so a CPU-only CI machine with the CUDA toolkit compiles and
links it on every run. Knobs:

* ``FP_RECIPES_NO_CUDA=1``: skip the extension on purpose.
* ``FP_RECIPES_CUDA_ARCHS``: ``;``-separated archs, default ``90a;100a``.
* ``FP_RECIPES_NVCC_THREADS``: parallel nvcc jobs (default: number of CPUs).

Beside it, where torch is importable at build time (``pip install --no-build-isolation``), the optional
``fp_recipes._torch_ops`` (csrc/torch_ops): the eager FP8 casts and GEMMs as one torch-linked C++ call each, on
top of ``_C``'s kernels (csrc/kernel_table.h). Its build may fail without failing the install: the Python
host path then runs (``python -m fp_recipes doctor`` says which).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "fp_recipes" / "csrc"
DEFAULT_ARCHS = "90a;100a"


def _log(msg: str) -> None:
    print(f"[fp_recipes setup] {msg}", file=sys.stderr, flush=True)


def _find_nvcc() -> str | None:
    for candidate in (
        os.environ.get("NVCC"),
        shutil.which("nvcc"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
    ):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _cuda_home(nvcc: str) -> Path:
    """The toolkit root: CUDA_HOME, else the nvcc's parent (nvcc may be a wrapper script)."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if candidate and (Path(candidate) / "include" / "cuda_runtime.h").is_file():
            return Path(candidate)
    root = Path(nvcc).resolve().parent.parent
    if (root / "include" / "cuda_runtime.h").is_file():
        return root
    return Path("/usr/local/cuda")


def _gencode_flags(archs: str) -> list[str]:
    flags = []
    for arch in filter(None, (a.strip() for a in archs.split(";"))):
        if not arch.rstrip("af").isdigit():
            raise SystemExit(
                f"FP_RECIPES_CUDA_ARCHS has a bad entry {arch!r}; expected e.g. '90a;100a'"
            )
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    if not flags:
        raise SystemExit("FP_RECIPES_CUDA_ARCHS is empty; expected e.g. '90a;100a'")
    return flags


class NvccBuildExt(build_ext):
    """Compile ``csrc/*.cu`` with nvcc, then link them with the pybind11 ``.cpp`` bindings; build the optional
    torch-linked module, warning instead of failing when it does not build."""

    def build_extension(self, ext: Extension) -> None:
        if getattr(ext, "_optional", False):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - any compiler or linker failure
                _log(f"WARNING: the optional {ext.name} did not build ({type(exc).__name__}: {exc}); "
                     "the Python host path runs instead")
            return
        nvcc = ext._nvcc  # type: ignore[attr-defined]
        archs = os.environ.get("FP_RECIPES_CUDA_ARCHS", DEFAULT_ARCHS)
        cuda_home = _cuda_home(nvcc)
        obj_dir = Path(self.build_temp) / "cuda_objs"
        obj_dir.mkdir(parents=True, exist_ok=True)
        cu_files = sorted(CSRC.glob("*.cu"))
        common = [
            "-O3",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-Xcompiler",
            "-fPIC",
            f"-I{CSRC}",
            *_gencode_flags(archs),
        ]

        def compile_one(src: Path) -> str:
            obj = obj_dir / (src.stem + ".o")
            # Numeric contracts forbid FMA contraction in reference-critical expressions.
            cmd = [nvcc, "-c", str(src), "-o", str(obj), "-fmad=false", *common]
            _log(" ".join(cmd))
            subprocess.check_call(cmd)
            return str(obj)

        jobs = int(os.environ.get("FP_RECIPES_NVCC_THREADS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_one, cu_files))
        _log(f"built {len(objects)} CUDA objects for archs {archs}")
        ext.extra_objects = list(ext.extra_objects or []) + objects
        ext.define_macros = list(ext.define_macros or []) + [("FP_RECIPES_ARCHS", f'"{archs}"')]
        ext.include_dirs = list(ext.include_dirs or []) + [str(cuda_home / "include")]
        ext.library_dirs = list(ext.library_dirs or []) + [
            str(cuda_home / "lib64"),
            str(cuda_home / "lib"),
        ]
        super().build_extension(ext)


def _extensions() -> tuple[list[Extension], dict]:
    if os.environ.get("FP_RECIPES_NO_CUDA", "").strip().lower() in {"1", "true", "yes", "on"}:
        _log("FP_RECIPES_NO_CUDA is set: skipping the CUDA extension fp_recipes._C")
        return [], {}
    nvcc = _find_nvcc()
    if nvcc is None:
        _log("nvcc not found: skipping the CUDA extension fp_recipes._C (reference backend only)")
        return [], {}
    import pybind11

    ext = Extension(
        "fp_recipes._C",
        sources=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.cpp"))],
        include_dirs=[pybind11.get_include(), str(CSRC)],
        # Static cudart: the module loads next to any torch build without a libcudart on the path.
        libraries=["cudart_static", "dl", "rt", "pthread"],
        extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"],
        language="c++",
    )
    ext._nvcc = nvcc  # type: ignore[attr-defined]
    _log(f"building the CUDA extension fp_recipes._C with {nvcc}")
    return [ext] + _torch_ops_extension(), {"build_ext": NvccBuildExt}


def _torch_ops_extension() -> list[Extension]:
    """``fp_recipes._torch_ops`` against the torch importable here (none under pip's build isolation)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _log("torch is not importable at build time: skipping fp_recipes._torch_ops (the host fast path; "
             "pip install --no-build-isolation builds it)")
        return []
    lib = str(Path(torch.__file__).parent / "lib")
    ext = Extension(
        "fp_recipes._torch_ops",
        sources=[str((CSRC / "torch_ops" / "fast_ops.cpp").relative_to(ROOT))],
        include_dirs=[*cpp_extension.include_paths(), str(CSRC)],
        library_dirs=[lib],
        runtime_library_dirs=[lib],
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        define_macros=[("TORCH_EXTENSION_NAME", "_torch_ops"), ("TORCH_API_INCLUDE_EXTENSION_H", None),
                       ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))],
        extra_compile_args=["-O2", "-g0", "-std=c++20", "-fvisibility=hidden"],  # -g0: Python's CFLAGS add -g
        language="c++",
    )
    ext._optional = True  # type: ignore[attr-defined]
    _log(f"building fp_recipes._torch_ops against torch {torch.__version__}")
    return [ext]


ext_modules, cmdclass = _extensions()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
