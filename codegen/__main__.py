"""``python -m codegen [--check] [--root DIR]``."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from codegen._generate import generate, generated_dirs
from codegen._model import SchemaError


def main(argv: list[str] | None = None) -> int:
    """Write the generated files, or with ``--check`` report any that are stale."""
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="fail with a diff if anything is stale"
    )
    parser.add_argument(
        "--root", type=Path, default=Path.cwd(), help="repository root (default: cwd)"
    )
    args = parser.parse_args(argv)
    root: Path = args.root
    try:
        files = generate(root)
    except SchemaError as exc:
        print(f"codegen: {exc}", file=sys.stderr)
        return 2
    stale: list[Path] = []
    for rel, content in files.items():
        target = root / rel
        current = target.read_bytes() if target.exists() else None
        if current == content:
            continue
        stale.append(rel)
        if args.check:
            old = (current or b"").decode(errors="replace").splitlines(keepends=True)
            new = content.decode().splitlines(keepends=True)
            sys.stdout.writelines(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
    expected = set(files)
    for folder in generated_dirs():
        for path in sorted((root / folder).glob("*")) if (root / folder).is_dir() else []:
            rel = path.relative_to(root)
            if path.is_file() and rel not in expected and path.suffix in (".py", ".json"):
                stale.append(rel)
                if args.check:
                    print(f"codegen: {rel} is not produced by the generator (remove it)")
                else:
                    path.unlink()
    if args.check:
        if stale:
            print(
                f"codegen: {len(stale)} generated file(s) are stale; run `python -m codegen`",
                file=sys.stderr,
            )
            return 1
        print(f"codegen: {len(files)} generated files are up to date")
        return 0
    print(f"codegen: wrote {len(stale)} file(s), {len(files) - len(stale)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
