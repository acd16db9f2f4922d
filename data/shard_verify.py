"""`eyas verify RUN_DIR_OR_RECIPE`: the full check of a run's shards (every byte hashed).

`verify` checks every file of a dump against its manifest (size, header, sha256) and every shard's
offsets and sample index against the index (`ShardReader.shard_problem`): at once for the whole
dump, what the reader (`eyas.data.shard_reader`) checks lazily as training reads, with each whole
file hashed where the reader checks the CRC-32 of each sample it reads.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from eyas.config import load_recipe
from eyas.data.shard_format import INDEX, MANIFEST, read_manifest
from eyas.data.shard_reader import ShardReader, file_problems
from eyas.errors import EyasError
from eyas.io import sha256_file
from eyas.stage_cli import guarded, stage_parser
from eyas.targets import load_target_config, load_tokenizer, target_identity


def verify(shard_dir: str | Path) -> list[str]:
    """Full check of a dump: every file's size, header and sha256 against the manifest, and the
    shards' offsets against the index. Returns problems, one per file."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    found = file_problems(shard_dir, manifest)
    problems = [f"{path}: {problem}" for path, problem in found]
    flagged = {path for path, _ in found}
    for record in manifest["shards"] + [manifest["index"]]:
        path = shard_dir / record["file"]
        if path not in flagged and sha256_file(path) != record["sha256"]:
            problems.append(f"{path}: checksum mismatch (corrupt)")
            flagged.add(path)
    if shard_dir / INDEX not in flagged:
        reader = ShardReader(shard_dir, check_files=False)
        for i, record in enumerate(manifest["shards"]):
            path = shard_dir / record["file"]
            problem = "" if path in flagged else reader.shard_problem(i)
            if problem:
                problems.append(f"{path}: {problem}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """`eyas verify RUN_DIR_OR_RECIPE`: the full check of a run's shards (every byte hashed)."""
    parser = stage_parser("eyas verify", "check a run's shards in full: sizes, headers, sha256, offsets")
    args = parser.parse_args(argv)

    def body() -> int:
        where = Path(args.recipe)
        identity = None
        if where.is_dir():
            if args.overrides:
                raise EyasError("overrides (section.key=value) need a recipe file; "
                                "give the recipe instead of the folder")
            root = where / "shards" if (where / "shards" / MANIFEST).is_file() else where
        else:
            recipe = load_recipe(where, args.overrides)
            root = recipe.run_dir / "shards"
            if (root / MANIFEST).is_file():
                config = load_target_config(recipe.target.path, trust_remote_code=recipe.target.trust_remote_code)
                identity = target_identity(config, load_tokenizer(recipe.target))
        dirs = [d for d in (root, root / "heldout") if (d / MANIFEST).is_file()]
        if not dirs:
            raise EyasError(f"no shards at '{root}' ({MANIFEST} is missing); run `eyas dump RECIPE` first")
        problems: list[str] = []
        for d in dirs:
            started = time.perf_counter()
            manifest = read_manifest(d)
            found = verify(d)
            if identity is not None and manifest.get("target_identity") != identity:
                found.insert(0, f"{d}: dumped from another target or tokenizer (identity "
                                f"{manifest.get('target_identity')}, the recipe's target has {identity})")
            for line in found:
                print(f"eyas verify: {line}", flush=True)
            if not found:
                size = sum(r["bytes"] for r in manifest["shards"]) + manifest["index"]["bytes"]
                print(f"eyas verify: {d}: {len(manifest['shards'])} shards, {size / 1e6:.1f} MB, sizes, headers, "
                      f"checksums and offsets all match ({time.perf_counter() - started:.1f} s)", flush=True)
            problems += found
        if problems:
            raise EyasError(f"{len(problems)} problem(s) in the shards under '{root}' (listed above); "
                            "rerun `eyas dump RECIPE` with --reverify to repair them")
        return 0

    return guarded(body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
