"""The status page: one HTML file and its script, drawn from the status API in the browser.

``GET /dashboard`` answers ``static/dashboard.html``; ``/dashboard/static/NAME`` the files next
to it: the page's script and uPlot (https://github.com/leeoniya/uPlot, MIT, its license in
``static/uPlot.LICENSE``), copied from the npm registry's ``uplot`` tarball's ``dist/``. They
ship inside the package: a user runs no build step and the page loads nothing from elsewhere.
The page polls ``/v1/kvflow/status`` (``kvflow.router.status_api``) and holds nothing of its own.

To update uPlot: ``npm pack uplot``, then copy ``dist/uPlot.iife.min.js``,
``dist/uPlot.min.css`` and ``LICENSE`` (as ``uPlot.LICENSE``) here.
"""

from __future__ import annotations

from importlib import resources

PAGE_PATH = "/dashboard"
ASSET_PREFIX = "/dashboard/static/"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".LICENSE": "text/plain; charset=utf-8"}
ASSETS = ("dashboard.js", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE")
HEADERS = (("Cache-Control", "no-cache"), ("X-Content-Type-Options", "nosniff"),
           ("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'"))
"""The page runs only its own files; its inline style sheet is the one exception."""


def _read(name: str) -> bytes:
    return resources.files("kvflow.router").joinpath("static", name).read_bytes()


def page_file(path: str) -> tuple[bytes, str] | None:
    """The body and content type for ``path`` (the page or one of its assets), None for others."""
    if path in (PAGE_PATH, PAGE_PATH + "/"):
        return _read("dashboard.html"), _TYPES[".html"]
    name = path.removeprefix(ASSET_PREFIX)
    if path.startswith(ASSET_PREFIX) and name in ASSETS:
        suffix = name[name.rfind("."):]
        return _read(name), _TYPES[suffix]
    return None
