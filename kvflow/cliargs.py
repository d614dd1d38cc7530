"""The command-line parser every ``kvflow`` command uses: argparse, stricter and shorter.

* no abbreviations: ``--prefil`` is refused, never taken for ``--prefill``;
* a mistake is one line, ``kvflow up: unrecognized arguments: --prefil 1 (see --help)``, not the
  whole usage text (``--help`` still prints it).
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` and one-line errors (subcommands too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


__all__ = ["Parser"]
