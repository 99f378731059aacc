"""Shrink a Triton cache to what a cache hit loads, so it can travel between device calls.

Per compiled kernel, Triton stores every stage's IR (ttir, ttgir, llir, ptx, source)
beside the binary and its metadata JSON, and lists them all in a group file
`__grp__<name>.json`. A hit loads only the binary and the metadata
(`triton.compiler.CompiledKernel`), but `FileCacheManager.get_group` misses as soon as a
listed file is gone. So the IR files are deleted *and* dropped from their group's list;
the binaries, the metadata and every file no group lists (the compiled launchers) stay.

    python benchmarks/prune_triton_cache.py DIR      # prints files and bytes removed
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

KEEP_SUFFIXES = (".json", ".cubin", ".hsaco")  # metadata and the binaries a hit loads


def prune(cache_dir: str | os.PathLike) -> tuple[int, int]:
    """Delete the IR files of every kernel group under cache_dir; returns (files, bytes)."""
    files = removed = 0
    for grp in sorted(Path(cache_dir).rglob("__grp__*.json")):
        try:
            data = json.loads(grp.read_text())
            children = data["child_paths"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a group Triton could read either: leave it
        kept = {}
        for name, path in children.items():
            if name.endswith(KEEP_SUFFIXES):
                kept[name] = path
                continue
            p = Path(path)
            if p.is_file():
                removed += p.stat().st_size
                p.unlink()
                files += 1
        if len(kept) != len(children):
            data["child_paths"] = kept
            grp.write_text(json.dumps(data))
    return files, removed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    files, removed = prune(argv[0])
    print(f"pruned {files} IR files, {removed / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
