"""The one thing pyproject.toml cannot say: kvflow's C extension, built where a compiler is.

``kvflow._native`` (kvflow/_native.c) runs the loops a request goes through before it is
routed (the built-in tokenizer's words, the prompt's fingerprints, their lookup in the index);
without a C compiler the install goes on without it, and Python and numpy compute the same.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvflow._native", ["kvflow/_native.c"], optional=True,
                             extra_compile_args=["-O2"])])
