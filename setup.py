"""The package list for setuptools, read from the tree (the rest of the metadata is in pyproject.toml).

The repository root is the package `qwen35_fast` (ComfyUI loads the folder itself, under whatever name
it has), so every folder below the root that holds an `__init__.py` is `qwen35_fast.<folder>`. Reading
the tree keeps a new kernel folder from being left out of the wheel. tests/ and bench/ stay out;
web/ and example_workflows/ hold no Python and ship as data (see package-data in pyproject.toml).
"""
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ["tests", "tests.*", "bench", "bench.*", "build", "build.*", "venv", "venv.*"]
DATA_FOLDERS = ["web", "example_workflows"]


class BuildPy(build_py):
    """Leaves this file out: it sits in the package's folder but is not a module of the package."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "qwen35_fast" and m[1] == "setup")]


setup(
    packages=["qwen35_fast"]
    + [f"qwen35_fast.{name}" for name in find_packages(".", exclude=NOT_SHIPPED) + DATA_FOLDERS],
    cmdclass={"build_py": BuildPy},
)
