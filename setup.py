"""The one thing pyproject.toml cannot say: kvflow's C extension, built where a compiler is.

``kvflow._native`` (kvflow/_native.c) runs the router's per-decision loops over a prompt's
blocks; without a C compiler the install goes on without it, and numpy computes the same.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvflow._native", ["kvflow/_native.c"], optional=True,
                             extra_compile_args=["-O2"])])
