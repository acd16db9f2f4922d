"""`eyas.stages`: a stage is skipped when its output is current, and says why when it is not."""

from __future__ import annotations

import json

import pytest

from eyas import stages
from eyas.config import load_recipe
from eyas.stage_cli import stage_main


def _recipe(tmp_path, *overrides):
    return load_recipe(None, [f"run.output_dir={tmp_path}/runs", "run.name=st", *overrides])


def _prepare_body(recipe, calls):
    """Writes what a finished prepare leaves (its done files), counting the calls."""
    def body():
        out = recipe.run_dir / "prepared"
        for name in stages.STAGES["prepare"].done_files:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_text("{}")
        calls.append(1)
        return "result"
    return body


def test_current_output_is_skipped_and_a_changed_setting_reruns_with_the_reason(tmp_path):
    calls, lines = [], []
    recipe = _recipe(tmp_path)
    assert stages.run("prepare", recipe, _prepare_body(recipe, calls), say=lines.append) == (True, "result")
    assert lines == []  # a first run has nothing to explain
    assert stages.run("prepare", recipe, _prepare_body(recipe, calls), say=lines.append) == (False, None)
    assert len(calls) == 1 and lines[-1].startswith("skipped: ") and "current for these settings" in lines[-1]
    # A setting outside the stage's sections does not make it stale; one inside does.
    assert stages.check("prepare", _recipe(tmp_path, "train.lr=3e-4")).current
    changed = _recipe(tmp_path, "data.max_length=64", "run.seed=3")
    stages.run("prepare", changed, _prepare_body(changed, calls), say=lines.append)
    assert len(calls) == 2
    assert lines[-1] == "running again: data.max_length changed (2048 -> 64); run.seed changed (0 -> 3)"
    # --force runs a current stage.
    assert stages.run("prepare", changed, _prepare_body(changed, calls), force=True, say=lines.append)[0]
    assert len(calls) == 3 and lines[-1].startswith("--force")


def test_a_redone_upstream_stage_makes_the_next_one_stale(tmp_path):
    recipe = _recipe(tmp_path)
    stages.run("prepare", recipe, _prepare_body(recipe, []), say=print)
    shards = recipe.run_dir / "shards"

    def dump_body():
        (shards / "heldout").mkdir(parents=True, exist_ok=True)
        (shards / "manifest.json").write_text("{}")
        (shards / "heldout" / "manifest.json").write_text("{}")

    stages.run("dump", recipe, dump_body, say=print)
    assert stages.check("dump", recipe).current
    stages.run("prepare", recipe, _prepare_body(recipe, []), force=True, say=print)
    verdict = stages.check("dump", recipe)
    assert not verdict.current and verdict.reason == "the prepare output it reads has changed"
    # The dump's own settings are part of it too, and a deleted output file is noticed.
    stages.run("dump", recipe, dump_body, say=print)
    assert not stages.check("dump", _recipe(tmp_path, "draft.kind=mtp")).current
    (shards / "heldout" / "manifest.json").unlink()
    assert stages.check("dump", recipe).reason.endswith("manifest.json' is missing")


def test_input_files_are_fingerprinted(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text('{"text": "a"}\n')
    recipe = _recipe(tmp_path, f"data.source={source}")
    stages.run("prepare", recipe, _prepare_body(recipe, []), say=print)
    assert stages.check("prepare", recipe).current
    source.write_text('{"text": "a longer row"}\n')  # same path, other content
    assert stages.check("prepare", recipe).reason == "the files it reads have changed"


def test_an_unfinished_run_leaves_no_record_and_an_old_record_is_dropped_first(tmp_path):
    recipe = _recipe(tmp_path)
    ckpt = recipe.run_dir / "checkpoints" / "step_00000002"

    def train_body(outcome):
        def body():
            ckpt.mkdir(parents=True, exist_ok=True)
            return {"outcome": outcome, "checkpoint": ckpt}
        return body

    args = dict(files=lambda r: [r["checkpoint"]], finished=lambda r: r["outcome"] == "done", say=print)
    stages.run("train", recipe, train_body("SIGUSR1"), **args)
    assert stages.read_record("train", recipe) is None and not stages.check("train", recipe).current
    stages.run("train", recipe, train_body("done"), **args)
    record = stages.read_record("train", recipe)
    assert record["files"] == ["step_00000002"] and stages.check("train", recipe).current

    def crash():
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        stages.run("train", _recipe(tmp_path, "train.lr=1e-3"), crash, say=print)
    assert stages.read_record("train", recipe) is None  # the old record no longer vouches for the output


def test_stage_main_loads_the_recipe_and_writes_it_to_the_run_directory(tmp_path, capsys):
    seen = []
    rc = stage_main("prepare", [f"run.output_dir={tmp_path}/runs", "run.name=r9", "data.max_length=77"],
                    lambda recipe, args: seen.append((recipe, args.force)))
    assert rc == 0 and seen[0][0].data.max_length == 77 and seen[0][1] is False
    assert load_recipe(tmp_path / "runs" / "r9" / "recipe.yaml") == seen[0][0]
    # A user error is one line and exit status 2.
    assert stage_main("prepare", ["data.max_lenght=1"], lambda r, a: None) == 2
    err = capsys.readouterr().err
    assert err.startswith("eyas: error: unknown recipe key 'data.max_lenght'") and err.count("\n") == 1


def test_record_is_plain_json_beside_the_output(tmp_path):
    recipe = _recipe(tmp_path)
    stages.run("prepare", recipe, _prepare_body(recipe, []), say=print)
    record = json.loads((recipe.run_dir / "prepared" / stages.RECORD).read_text())
    assert record["stage"] == "prepare" and record["sections"]["data"]["max_length"] == 2048
    assert set(record["sections"]) == {"target", "data", "run.seed"}


# --- the stage table (eyas.pipeline), the command table (eyas.cli.commands) and their readers ------------------------------------


def test_every_command_module_imports_and_has_main():
    import importlib

    from eyas.cli.commands import COMMANDS

    for name, command in COMMANDS.items():
        module = importlib.import_module(command.module)
        assert callable(getattr(module, "main", None)), f"{name}: {command.module} has no main(argv)"


def test_eyas_help_lists_the_table_and_an_unknown_command_names_it(capsys):
    from eyas.cli.commands import COMMANDS
    from eyas.cli.main import main

    assert main(["--help"]) == 0
    listed = [line.split(None, 1) for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == [[name, command.help] for name, command in COMMANDS.items()]
    assert main(["zzzz"]) == 2
    assert capsys.readouterr().err.strip() == f"eyas: error: unknown command 'zzzz'; commands: {', '.join(COMMANDS)}"


def test_a_stage_help_is_the_table_line_handed_down(capsys, monkeypatch):
    """`eyas prepare --help` shows the table's help, which the dispatcher hands down (no stage imports the
    table); a stage's `main` called directly shows its module docstring's first line instead."""
    from eyas import stage_cli
    from eyas.cli.commands import COMMANDS
    from eyas.cli.main import main
    from eyas.data import prepare

    for name in ("prepare", "dump", "train"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert COMMANDS[name].help in " ".join(capsys.readouterr().out.split()), name
    monkeypatch.setattr(stage_cli, "_HELP", {})
    with pytest.raises(SystemExit):
        prepare.main(["--help"])
    assert prepare.__doc__.splitlines()[0] in " ".join(capsys.readouterr().out.split())


def test_pipeline_stages_read_only_earlier_stages_and_write_apart(tmp_path):
    from eyas.cli.commands import COMMANDS, TOOLS
    from eyas.pipeline import PIPELINE, STAGES

    assert list(stages.STAGES) == list(PIPELINE) == ["prepare", "dump", "train", "eval", "export"]
    assert [name for name in COMMANDS if name not in {t.name for t in TOOLS}] == list(PIPELINE)
    assert all((COMMANDS[name].module, COMMANDS[name].help) == (STAGES[name].module, STAGES[name].help)
               for name in PIPELINE)  # a stage's command is its row of the stage table
    assert list(COMMANDS)[:len(PIPELINE)] == list(PIPELINE)  # `eyas --help` lists the stages first, in run order
    for overrides in ((), ("train.source=online", "eval.prompts=heldout")):
        recipe = _recipe(tmp_path, *overrides)
        outputs = {stages.output_dir(name, recipe) for name in PIPELINE}
        assert len(outputs) == len(PIPELINE)  # one folder (and one stage.json) per stage
        for index, name in enumerate(PIPELINE):
            assert set(stages.STAGES[name].upstream(recipe)) <= set(PIPELINE[:index]), (name, overrides)
            assert set(stages.settings(name, recipe)) == set(stages.STAGES[name].sections)


def test_slurm_job_order_is_the_table_order(tmp_path, capsys):
    from eyas.pipeline import PIPELINE, STAGES
    from eyas.slurm import submit

    jobs = [job for name in PIPELINE for job in STAGES[name].slurm_jobs]
    assert all(submit.template_text(job) for job in jobs)  # every job has its template in the package
    argv = [f"run.output_dir={tmp_path}/runs", "run.name=sl", "--stage", "all", "--gpus-per-node", "4", "--dry-run"]
    assert submit.main(argv) == 0
    printed = [line.split()[0] for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == jobs
    # The GPUs each job holds on GPU nodes are the table's (none for the jobs it runs on the host alone).
    recipe = _recipe(tmp_path)
    expected = {"node": "#SBATCH --gpus-per-node=4", "one": "#SBATCH --gpus=1", "none": None}
    for name in PIPELINE:
        for job in STAGES[name].slurm_jobs:
            lines = (tmp_path / "runs" / "sl" / "slurm" / f"{job}.sbatch").read_text().splitlines()
            gpu_lines = [line for line in lines if line.startswith("#SBATCH --gpus")]
            host_only = job in STAGES[name].slurm_host_jobs
            want = None if host_only else expected[STAGES[name].slurm_gpus(recipe)]
            assert gpu_lines == ([want] if want else []), job


def test_quickstart_runs_the_table_stages_in_order(tmp_path, monkeypatch, capsys):
    from eyas.cli import quickstart
    from eyas.pipeline import PIPELINE

    assert quickstart.STAGES == ("target", *PIPELINE) and tuple(quickstart.STEPS) == quickstart.STAGES
    ran = []

    def step(name):
        def run(session, say):
            ran.append(name)
            say(f"ran {name}")
            return name != "dump", None  # a skipped stage is timed and marked as such
        return quickstart.Step(lambda session: f"about {name}", run)

    monkeypatch.setattr(quickstart, "STEPS", {name: step(name) for name in reversed(quickstart.STAGES)})
    recipe = _recipe(tmp_path)
    progress = quickstart.Progress(recipe.run_dir)
    quickstart.run_steps(quickstart.Session(recipe, False, quickstart.Target(recipe)), progress)
    assert ran == list(quickstart.STAGES)
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    total = len(quickstart.STAGES)
    assert headers[:3] == [f"[1/{total}] target: about target", f"[1/{total}] target: ran target",
                           f"[1/{total}] target: done in 0 s"]
    assert [h.split(":")[0] for h in headers if ": about " in h] == [f"[{i}/{total}] {n}" for i, n in
                                                                   enumerate(quickstart.STAGES, start=1)]
    assert list(progress.timings) == list(quickstart.STAGES)
    assert [n for n, t in progress.timings.items() if t["skipped"]] == ["dump"]
