"""Write models/mpnet/calibration.txt: first sentences of Python standard-library docstrings.

Technical prose about programming, a different kind of text from the everyday English evaluation sentences of
models/minilm/evaluation.txt. The committed file was made with CPython 3.11; rerunning on another version may
change a few sentences, which is why the result is committed rather than made at run time.

    python models/mpnet/make_calibration.py
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from pathlib import Path

MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools", "gzip", "hashlib", "heapq",
    "http.client", "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox", "operator", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "typing", "unittest", "urllib.parse",
    "uuid", "wave", "zipfile",
)
COUNT = 171
WORDS = (6, 40)


def first_sentence(docstring: str) -> str | None:
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    sentence = match.group(1) if match else None
    if sentence is None or not WORDS[0] <= len(sentence.split()) <= WORDS[1]:
        return None
    # Signatures and doctest lines are code, not prose.
    if any(mark in sentence for mark in (">>>", "->", "(*", "**", "==", "__")):
        return None
    return sentence


def collect() -> list[str]:
    found: dict[str, None] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attribute, value in sorted(vars(module).items()):
            if attribute.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            members = [value]
            if inspect.isclass(value):
                members += [member for key, member in sorted(vars(value).items()) if not key.startswith("_")]
            for member in members:
                sentence = first_sentence(inspect.getdoc(member) or "")
                if sentence:
                    found.setdefault(sentence)
    return list(found)


def main() -> None:
    sentences = collect()
    random.Random(0).shuffle(sentences)
    path = Path(__file__).with_name("calibration.txt")
    path.write_text("\n".join(sorted(sentences[:COUNT])) + "\n", encoding="utf-8")
    print(f"{min(COUNT, len(sentences))} of {len(sentences)} sentences -> {path}")


if __name__ == "__main__":
    main()
