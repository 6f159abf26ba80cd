"""Package count and installed size of the core install and of each extra, read off an environment that holds them
(README's test environment holds all but tensorrt): what each declared tree reaches, through the installed metadata,
and the bytes each distribution's RECORD lists. Prints README's table rows.

    .venv/bin/python .ci/install_sizes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dependency_tree import INSTALLER, PROJECT, declared, extras_of, installed, installed_size, walk  # noqa: E402


def main() -> int:
    available = installed()
    core = set(walk(declared(), available).reached) | INSTALLER | {PROJECT}
    core_bytes = sum(installed_size(available[name]) for name in core if name in available)
    print("| install | packages | installed size |")
    print("|---|---|---|")
    print(f"| core (`pip install nmdeploy`) | {len(core)} | {core_bytes / 1e6:,.0f} MB |")
    for extra in extras_of():
        tree = walk(declared([extra]), available)
        if tree.missing:
            print(f"| `{extra}` | not installed here ({', '.join(tree.missing)}) | - |")
            continue
        added = set(tree.reached) - core
        added_bytes = sum(installed_size(available[name]) for name in added)
        total = len(core | added)
        print(f"| `[{extra}]` | +{len(added)} ({total} in all) | +{added_bytes / 1e6:,.0f} MB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
