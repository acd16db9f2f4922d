"""`eyas submit` without a cluster: rendered scripts, chaining, resources and errors (--dry-run)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from eyas.config import load_recipe
from eyas.errors import EyasError
from eyas.slurm import submit


@pytest.fixture()
def recipe_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "subm", "output_dir": "runs"}, "train": {"lr": 2e-4}}))
    return path


def _dry(recipe_file: Path, *extra: str, capsys=None) -> tuple[int, str]:
    rc = submit.main([str(recipe_file), "--dry-run", *extra])
    out = capsys.readouterr() if capsys else None
    return rc, (out.out + out.err) if out else ""


def _slurm_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "subm" / "slurm"


def test_all_stages_chained_in_order_and_scripts_are_valid_bash(recipe_file, tmp_path, capsys):
    rc, out = _dry(recipe_file, "--stage", "all", "--gpus-per-node", "0", "--procs-per-node", "2", capsys=capsys)
    assert rc == 0, out
    lines = [line.split() for line in out.strip().splitlines()]
    names = [parts[0] for parts in lines]
    assert names == ["prepare", "dump", "dump_finalize", "train", "eval", "export"]
    # Each job after the first depends on the one before it.
    for previous, parts in zip(names, lines[1:]):
        assert f"--dependency=afterok:<{previous}>" in parts
    assert "--dependency" not in " ".join(lines[0])
    slurm_dir = _slurm_dir(tmp_path)
    for name in names:
        text = (slurm_dir / f"{name}.sbatch").read_text()
        assert "{{" not in text and "}}" not in text, name
        assert subprocess.run(["bash", "-n", str(slurm_dir / f"{name}.sbatch")]).returncode == 0, name
        assert "#SBATCH --open-mode=append" in text and "#SBATCH --requeue" in text
        assert f"#SBATCH --output={slurm_dir / 'logs'}/" in text


def test_train_script_cpu_launcher_and_preemption(recipe_file, tmp_path, capsys):
    rc, _ = _dry(recipe_file, "--stage", "train", "--gpus-per-node", "0", "--procs-per-node", "2",
                 "--signal-seconds", "90", capsys=capsys)
    assert rc == 0
    text = (_slurm_dir(tmp_path) / "train.sbatch").read_text()
    assert "#SBATCH --nodes=1" in text and "#SBATCH --ntasks-per-node=1" in text
    assert "#SBATCH --cpus-per-task=2" in text
    assert "#SBATCH --signal=B:USR1@90" in text
    assert "--gpus" not in text.split("set -uo")[0]
    assert 'CUDA_VISIBLE_DEVICES=""' in text  # gloo on CPU nodes
    assert "--nproc-per-node 2" in text and "--nnodes 1" in text
    assert "trap on_usr1 USR1" in text and 'scontrol requeue "${SLURM_JOB_ID}"' in text
    assert 'scontrol show hostnames "${SLURM_JOB_NODELIST}"' in text
    assert re.search(r"-m eyas\.train \S+/slurm/recipe\.yaml", text)


def test_gpu_resources_per_stage(recipe_file, tmp_path, capsys):
    rc, _ = _dry(recipe_file, "--stage", "all", "--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu",
                 "--time", "4:00:00", "--sbatch-arg=--qos=high", "--launcher", "accelerate", capsys=capsys)
    assert rc == 0
    slurm_dir = _slurm_dir(tmp_path)
    train = (slurm_dir / "train.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=8" in train and "#SBATCH --nodes=2" in train
    assert "#SBATCH --cpus-per-task=64" in train and "CUDA_VISIBLE_DEVICES" not in train
    assert "--num_machines 2 --num_processes 16" in train and '--machine_rank="${SLURM_NODEID}"' in train
    dump = (slurm_dir / "dump.sbatch").read_text()
    assert "#SBATCH --array=0-15" in dump and "#SBATCH --gpus=1" in dump and "#SBATCH --cpus-per-task=8" in dump
    for name in ("prepare", "dump", "train", "eval", "export"):
        text = (slurm_dir / f"{name}.sbatch").read_text()
        assert "#SBATCH --partition=gpu" in text and "#SBATCH --time=4:00:00" in text and "#SBATCH --qos=high" in text
    assert "--gpus" not in (slurm_dir / "export.sbatch").read_text()
    assert "--gpus" not in (slurm_dir / "prepare.sbatch").read_text()


def test_resolved_recipe_keeps_overrides_with_absolute_run_dir(recipe_file, tmp_path, capsys):
    rc, _ = _dry(recipe_file, "--stage", "eval", "train.lr=3e-4", "eval.max_prompts=7", capsys=capsys)
    assert rc == 0
    resolved = load_recipe(_slurm_dir(tmp_path) / "recipe.yaml")
    assert resolved.train.lr == 3e-4 and resolved.eval.max_prompts == 7
    assert resolved.run.output_dir == str(tmp_path / "runs")
    assert resolved.run_dir == tmp_path / "runs" / "subm"


def test_online_training_skips_dump(recipe_file, capsys):
    rc, out = _dry(recipe_file, "--stage", "all", "train.source=online", capsys=capsys)
    assert rc == 0
    assert [line.split()[0] for line in out.strip().splitlines()] == ["prepare", "train", "eval", "export"]


def test_comma_list_is_put_in_pipeline_order(recipe_file, capsys):
    rc, out = _dry(recipe_file, "--stage", "dump,prepare", capsys=capsys)
    assert rc == 0
    assert [line.split()[0] for line in out.strip().splitlines()] == ["prepare", "dump", "dump_finalize"]


@pytest.mark.parametrize("args, message", [
    (["--stage", "trian"], "--stage 'trian' is not a stage"),
    (["--gpus-per-node", "4", "--procs-per-node", "2"], "--procs-per-node 2 differs from --gpus-per-node 4"),
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--sbatch-arg", "qos=high"], "--sbatch-arg 'qos=high' must be one sbatch option"),
    (["--launcher", "accelerate", "--accelerate-config", "nope.yaml"], "--accelerate-config 'nope.yaml' does not exist"),
])
def test_bad_options_are_one_line_errors(recipe_file, capsys, args, message):
    rc, out = _dry(recipe_file, *args, capsys=capsys)
    assert rc == 2
    assert message in out and "Traceback" not in out


def test_missing_sbatch_is_a_clear_error(recipe_file, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    rc = submit.main([str(recipe_file), "--stage", "eval"])
    assert rc == 2
    assert "'sbatch' is not on PATH" in capsys.readouterr().err


def test_render_refuses_unfilled_placeholders():
    with pytest.raises(EyasError, match="placeholder '{{nodes}}' has no value"):
        submit.render("#SBATCH --nodes={{nodes}}", {})
    assert submit.render("a {{x}} b {{x}}", {"x": 3}) == "a 3 b 3"
