"""Study data kept in the repository: a run's prepared conversations (tokens, loss masks, messages), so a study
starts at the dump instead of regenerating its replies through the target (10 minutes for the quickstart's
620 on a 2-core CPU; the widened recipe's 2,200 two-turn conversations took 50 minutes on an AMX machine and
would take hours on an AVX2-only one, where its committed 550 took about two hours).

    python benchmarks/study_data.py restore quickstart --run runs/quickstart   # then: eyas dump runs/quickstart/recipe.yaml
    python benchmarks/study_data.py restore widened --run runs/widened         # 550 two-turn conversations, 13 categories
    python benchmarks/study_data.py pack runs/quickstart --name quickstart --recipe recipes/quickstart.yaml
    python benchmarks/study_data.py check quickstart                           # the archive against its manifest
    python benchmarks/study_data.py --smoke        # every committed set restored and packed again under a temp folder

A set is two files under `benchmarks/data/`: `<name>.tar.xz`, the run's `prepared/` folder as `eyas prepare`
wrote it (the `datasets` splits, info.json, skipped.json and its stage record; not its tokenizer cache), and
`<name>.json`, its manifest: the archive's sha256, each file's sha256 and size, the recipe that prepared it
(written to the run as `recipe.yaml` on restore, its `run.output_dir` and `run.name` naming the folder restored
into) and the split sizes. `restore` refuses an archive or a file
whose checksum differs, and a run folder that already holds prepared data; the restored prepare record is
current for the recipe (`eyas prepare` on it does nothing), so `eyas dump` reads it as its own.

`--smoke` (the bench tier's check that the script still runs) restores every committed set into a temp folder,
packs it again there and fails unless every file's sha256 is its manifest's: the round trip a new set takes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
SKIPPED_PARTS = (".cache",)  # the tokenizer's map cache: rebuilt on demand, and 6x the data's size


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _prepared_files(prepared: Path) -> list[Path]:
    return sorted(p for p in prepared.rglob("*")
                  if p.is_file() and not set(p.relative_to(prepared).parts) & set(SKIPPED_PARTS))


def pack(run: Path, name: str, recipe: Path, out: Path = DATA) -> dict:
    """Write `<out>/<name>.tar.xz` and its manifest from `run`'s prepared folder; returns the manifest."""
    prepared = run / "prepared"
    if not (prepared / "stage.json").is_file():
        sys.exit(f"study_data: no finished prepare in {prepared} (no stage.json); run `eyas prepare` first")
    files = _prepared_files(prepared)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as archive:
        for path in files:  # fixed owner and times: the same folder packs to the same bytes
            info = archive.gettarinfo(str(path), arcname=str(Path("prepared") / path.relative_to(prepared)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            archive.addfile(info, path.open("rb"))
    blob = buffer.getvalue()
    info_json = json.loads((prepared / "info.json").read_text())
    manifest = {
        "name": name, "archive": f"{name}.tar.xz", "sha256": sha256(blob), "bytes": len(blob),
        "files": {str(p.relative_to(prepared)): {"sha256": sha256(p.read_bytes()), "bytes": p.stat().st_size}
                  for p in files},
        "splits": info_json.get("splits", {}), "tokenizer_identity": info_json.get("tokenizer_identity"),
        "recipe": recipe.read_text(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / manifest["archive"]).write_bytes(blob)
    (out / f"{name}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_manifest(name: str, data: Path = DATA) -> dict:
    path = data / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in data.glob("*.json"))
        sys.exit(f"study_data: no study data set '{name}' in {data}; sets: {', '.join(known) or 'none'}")
    return json.loads(path.read_text())


def checked_archive(manifest: dict, data: Path = DATA) -> bytes:
    """The archive's bytes, refused unless their sha256 is the manifest's."""
    blob = (data / manifest["archive"]).read_bytes()
    if sha256(blob) != manifest["sha256"]:
        sys.exit(f"study_data: {data / manifest['archive']} does not match its manifest's sha256 "
                 f"({sha256(blob)[:12]} != {manifest['sha256'][:12]}): the file is damaged or was replaced; "
                 "restore it from git (git checkout -- benchmarks/data)")
    return blob


def recipe_with(recipe: str, section: str, values: dict[str, str], note: str = "") -> str:
    """`recipe`'s text with each `section.key` line set to `key: value` (its comment replaced by `note`), added at
    the section's top where absent; every other line, comments included, kept as it is."""
    block = re.search(rf"^{section}:\n(?:[ #].*\n|\n)*", recipe, re.MULTILINE)
    if block is None:
        sys.exit(f"study_data: the recipe has no `{section}:` section; write one in it first")
    text = block.group(0)
    for key, value in values.items():
        line = f"  {key}: {value}{note}"
        pattern = re.compile(rf"^  {key}:.*$", re.MULTILINE)
        text = (pattern.sub(lambda _, line=line: line, text, count=1) if pattern.search(text)
                else text.replace(f"{section}:\n", f"{section}:\n{line}\n", 1))
    return recipe[:block.start()] + text + recipe[block.end():]


def recipe_for_run(recipe: str, run: Path) -> str:
    """The set's recipe with its `run.output_dir` and `run.name` naming `run`, so every stage run on the restored
    recipe reads and writes that folder (the packed recipe names the folder it was prepared in)."""
    # JSON strings are YAML strings: a folder name with a colon or a hash stays one value
    return recipe_with(recipe, "run", {"name": json.dumps(run.name), "output_dir": json.dumps(str(run.parent))})


def restore(name: str, run: Path, data: Path = DATA) -> Path:
    """Unpack the set into `run/prepared` (and its recipe, pointed at `run`, into `run/recipe.yaml`), every
    file checked."""
    manifest = load_manifest(name, data)
    blob = checked_archive(manifest, data)
    prepared = run / "prepared"
    if prepared.exists():
        sys.exit(f"study_data: {prepared} exists; restore into a new run folder (or remove it first)")
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:xz") as archive:
        members = archive.getmembers()
        names = {m.name.removeprefix("prepared/") for m in members}
        if names != set(manifest["files"]) or not all(m.isfile() and ".." not in Path(m.name).parts for m in members):
            sys.exit(f"study_data: {manifest['archive']} holds other files than its manifest lists")
        for member in members:
            body = archive.extractfile(member).read()
            relative = member.name.removeprefix("prepared/")
            if sha256(body) != manifest["files"][relative]["sha256"]:
                sys.exit(f"study_data: {relative} in {manifest['archive']} does not match its manifest's sha256")
            target = prepared / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
    (run / "recipe.yaml").write_text(recipe_for_run(manifest["recipe"], run))
    return prepared


def smoke() -> None:
    """Each committed set restored and packed again in a temp folder, every file checked against its manifest."""
    from machine import bench_lines, smoke_dir, smoke_note, write_json  # benchmarks/machine.py (here: the tests import this module)

    smoke_note("study_data")
    work, report = smoke_dir("study_data"), {}
    for name in sorted(p.stem for p in DATA.glob("*.json")):
        manifest = load_manifest(name)
        started = time.perf_counter()
        run = work / name
        restore(name, run)
        restored_s = time.perf_counter() - started
        again = pack(run, name, run / "recipe.yaml", out=work / "packed")
        if again["files"] != manifest["files"] or again["recipe"] != recipe_for_run(manifest["recipe"], run):
            sys.exit(f"study_data --smoke: {name} packed again differs from its manifest's files or recipe")
        report[name] = {"restore_s": round(restored_s, 3), "archive_bytes": manifest["bytes"],
                        "files": len(manifest["files"]), "repacked_archive_equal": again["sha256"] == manifest["sha256"]}
        bench_lines(f"study_data_{name}_restore {restored_s:.3f} s", f"study_data_{name}_archive {manifest['bytes']} bytes")
    write_json(work / "study_data_smoke.json", report, indent=1)
    print(f"study_data --smoke: {len(report)} set(s) restored and packed again in {work}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="restore every committed set into a temp folder and pack it again, each file checked")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("pack", help="archive a run's prepared data as a study data set")
    p.add_argument("run", type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--recipe", type=Path, required=True, help="the recipe that prepared it (restored as recipe.yaml)")
    r = sub.add_parser("restore", help="unpack a study data set into a run folder")
    r.add_argument("name")
    r.add_argument("--run", type=Path, required=True)
    c = sub.add_parser("check", help="check a set's archive against its manifest")
    c.add_argument("name")
    args = parser.parse_args()
    if args.smoke:
        smoke()
    elif args.command is None:
        parser.error("give a command: pack, restore or check (or --smoke)")
    elif args.command == "pack":
        manifest = pack(args.run, args.name, args.recipe)
        print(f"study_data: {DATA / manifest['archive']} ({manifest['bytes']:,} bytes, sha256 {manifest['sha256']}): "
              f"{len(manifest['files'])} files, splits {manifest['splits']}")
    elif args.command == "restore":
        prepared = restore(args.name, args.run)
        print(f"study_data: {args.name} restored into {prepared}; next: eyas dump {args.run / 'recipe.yaml'}")
    else:
        manifest = load_manifest(args.name)
        checked_archive(manifest)
        print(f"study_data: {manifest['archive']} matches its manifest (sha256 {manifest['sha256']})")


if __name__ == "__main__":
    main()
