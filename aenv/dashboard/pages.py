"""The dashboard's files: one HTML page, its script and style, and the vendored chart library.

They hold no data and open without the API key; the page's script asks for the key once (kept in
the tab's sessionStorage), sends it as the ``X-API-Key`` header to the key-protected JSON API and
builds the page from the answers with DOM text nodes only. Every file is served with a strict
Content-Security-Policy (scripts and styles from this origin only, no inline code, no framing).
"""

from __future__ import annotations

from importlib import resources

from starlette.responses import Response

PREFIX = "/dashboard"
STATIC = PREFIX + "/static/"
FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "chart.umd.min.js": "text/javascript; charset=utf-8",
    "chart.js-LICENSE.md": "text/plain; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_page(method: str, path: str) -> bool:
    """A dashboard file: open without the API key (the data behind it is not)."""
    if method not in ("GET", "HEAD"):
        return False
    return path in (PREFIX, PREFIX + "/") or (path.startswith(STATIC) and path[len(STATIC) :] in FILES)


def page(path: str) -> Response | None:
    """The file at ``path`` (one ``is_page`` accepts), else None."""
    if path in (PREFIX, PREFIX + "/"):
        return _file("index.html", "text/html; charset=utf-8")
    name = path[len(STATIC) :] if path.startswith(STATIC) else ""
    media_type = FILES.get(name)
    return _file(name, media_type) if media_type else None


def _file(name: str, media_type: str) -> Response:
    content = resources.files(__package__).joinpath("static", name).read_bytes()
    return Response(content, media_type=media_type, headers=HEADERS)
