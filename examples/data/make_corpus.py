"""Rebuild `corpus.txt`, the small English corpus `meshplan run` trains on by default.

    python examples/data/make_corpus.py            # writes examples/data/corpus.txt

How it was made: the text is the documentation that ships inside CPython itself: the
docstrings (`inspect.getdoc`) of a fixed list of standard-library modules and of their
public classes and functions, in that order. CPython's documentation is under the
Python Software Foundation License (PSF-2.0), which permits redistribution; see
https://docs.python.org/3/license.html. Nothing is downloaded.

Only prose-like docstrings are kept (at least 200 characters, mostly letters), each
once, ASCII only, and the output stops at about 400 KB. Docstrings differ a little
between Python versions, so the committed file is the reference; this script says where
it came from and makes a similar one.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

MODULES = [
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "colorsys", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fnmatch", "fractions",
    "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
    "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox", "math",
    "mimetypes", "multiprocessing", "numbers", "operator", "optparse", "os", "pathlib", "pickle",
    "pkgutil", "platform", "poplib", "pprint", "queue", "random", "re", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "sqlite3", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time",
    "timeit", "tokenize", "trace", "traceback", "turtle", "types", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "wave", "xml.dom.minidom", "zipfile", "zlib",
]  # fmt: skip

LIMIT = 400_000  # bytes: big enough not to be memorized in a demo run, small enough for the repo
MIN_LENGTH = 200


def docstrings(module_name: str):
    """The module's docstring, then those of its public classes, functions and methods."""
    module = importlib.import_module(module_name)
    yield inspect.getdoc(module)
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(value) or inspect.isfunction(value):
            yield inspect.getdoc(value)
        if inspect.isclass(value):
            for attr, member in sorted(vars(value).items()):
                if not attr.startswith("_") and inspect.isfunction(member):
                    yield inspect.getdoc(member)


def is_prose(text: str) -> bool:
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return len(text) >= MIN_LENGTH and text.isascii() and letters / len(text) > 0.85


def build() -> str:
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for module_name in MODULES:
        try:
            texts = list(docstrings(module_name))
        except Exception:  # a module missing on this platform (e.g. turtle without tkinter)
            continue
        for text in texts:
            if not text or text in seen or not is_prose(text):
                continue
            seen.add(text)
            parts.append(text.strip() + "\n")
            size += len(parts[-1]) + 1
            if size >= LIMIT:
                return "\n".join(parts)
    return "\n".join(parts)


def main() -> int:
    out = Path(__file__).with_name("corpus.txt")
    text = build()
    out.write_text(text, encoding="ascii")
    print(f"wrote {out} ({len(text.encode()):,} bytes, Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
