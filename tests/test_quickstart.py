"""The shipped recipes, and `eyas quickstart` end to end (on a tiny target) including its resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from eyas import stages
from eyas.cli import quickstart
from eyas.config import load_recipe
from eyas.targets import resolve_target_path

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def test_every_recipe_loads():
    names = {p.name for p in RECIPES}
    assert {"quickstart.yaml", "llama3.1-8b-eagle3.yaml", "qwen3-8b-eagle3.yaml", "llama3.1-8b-mtp3.yaml"} <= names
    for path in RECIPES:
        recipe = load_recipe(path)
        assert recipe.run.name == path.stem, path  # one run directory per recipe


@pytest.mark.parametrize("name", ["llama3.1-8b-eagle3.yaml", "qwen3-8b-eagle3.yaml"])
def test_eagle3_recipes_use_the_literature_settings(name):
    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / name)
    assert recipe.draft.kind == "eagle3" and recipe.dump.draft_vocab_size == 32000
    assert recipe.train.ttt_steps == 7 and recipe.train.ttt_decay == 0.8
    assert 5e-5 <= recipe.train.lr <= 1e-4 and recipe.train.epochs >= 1
    assert recipe.data.regenerate and recipe.data.max_length == 2048


def test_mtp_recipe_has_three_steps():
    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "llama3.1-8b-mtp3.yaml")
    assert recipe.draft.kind == "mtp" and recipe.draft.num_steps == 3 and recipe.train.ttt_steps == 3


def test_packaged_quickstart_recipe_runs_the_embedded_default():
    recipe = load_recipe(quickstart.packaged_recipe())
    assert recipe.target.path == "smollm2-135m-instruct" and recipe.data.source == "chitchat"
    assert recipe.run_dir == Path("runs") / "quickstart"
    assert recipe.eval.engine == "auto"  # vLLM's speedup beside eyas's wherever vLLM is installed


def _tiny_recipe(tmp_path: Path, target: Path) -> Path:
    recipe = yaml.safe_load(quickstart.packaged_recipe().read_text())
    recipe["run"].update(name="qs-tiny", output_dir=str(tmp_path / "runs"))
    recipe["target"]["path"] = str(target)
    recipe["data"].update(max_samples=60, max_length=96, heldout_fraction=0.1)
    recipe["dump"].update(draft_vocab_size=128, token_budget=1024, shard_tokens=1024)
    recipe["train"].update(max_steps=6, token_budget=512, eval_every=3, save_every=2, log_every=2, eval_batches=2)
    # eyas's decoder alone: vLLM's CPU attention takes no head this small (its side of `engine: auto` is
    # tests/test_vllm_parity.py::test_eval_engine_auto_serves_the_draft_in_vllm)
    recipe["eval"].update(max_prompts=2, max_new_tokens=12, engine="builtin")
    path = tmp_path / "qs.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_quickstart_runs_every_stage_then_resumes(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    recipe = _tiny_recipe(tmp_path, tiny_llama_dir)
    assert quickstart.main([str(recipe)]) == 0
    out = capsys.readouterr().out
    for index, stage in enumerate(quickstart.STAGES, start=1):
        assert f"[{index}/6] {stage}: done in" in out
    assert out.count("speculative decoding on ") == 1  # the acceptance table, once, at the end
    run_dir = tmp_path / "runs" / "qs-tiny"
    summary = json.loads((run_dir / "quickstart.json").read_text())
    assert set(summary["stages"]) == set(quickstart.STAGES)
    assert not any(s["skipped"] for s in summary["stages"].values()) and summary["history"] == []
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert Path(summary["files"]["plot"]).is_file() and Path(summary["files"]["report"]).is_file()
    assert (run_dir / "export" / "sglang" / "config.json").is_file()
    # Both engines' layouts are written and the last lines serve them with real paths (the vLLM line is run as
    # printed in test_the_quickstarts_vllm_line_serves_the_draft).
    assert (run_dir / "export" / "vllm" / "config.json").is_file()
    target, exports = tiny_llama_dir.resolve(), (run_dir / "export").resolve()
    assert (f"serve it with:     vLLM, on this machine too: python -m vllm.entrypoints.openai.api_server "
            f"--model {target} --speculative-config '{{\"model\": \"{exports / 'vllm'}\"") in out
    assert (f"serve it with:     SGLang, on GPUs: python -m sglang.launch_server --model-path {target} "
            f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {exports / 'sglang'} ") in out
    assert report["settings"]["drafts"] == [summary["files"]["checkpoint"]]
    assert "tau" in out and f"acceptance plot:   {summary['files']['plot']}" in out
    # The run's own recipe, the one error messages and the summary point to, is there and is this run's.
    assert load_recipe(run_dir / "recipe.yaml") == load_recipe(recipe)
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert steps[-1] == "step_00000006"
    weights = (run_dir / "checkpoints" / "step_00000006" / "model.safetensors").read_bytes()

    # Rerun: every stage is current, so none runs and the target is never loaded (patched where
    # the stages bind the loaders, and in eyas.targets for anything that looks them up there).
    import sys

    def no_load(*args, **kwargs):
        raise AssertionError("a rerun with every stage current loaded the target")

    for name, module in list(sys.modules.items()):
        if name == "eyas.targets" or (name.startswith("eyas.") and module is not None):
            for loader in ("load_target", "load_tokenizer"):
                if hasattr(module, loader):
                    monkeypatch.setattr(module, loader, no_load)
    assert quickstart.main([str(recipe)]) == 0
    out = capsys.readouterr().out
    summary2 = json.loads((run_dir / "quickstart.json").read_text())
    assert {k for k, s in summary2["stages"].items() if s["skipped"]} == set(quickstart.STAGES) - {"target"}
    for index, stage in enumerate(quickstart.STAGES[1:], start=2):
        assert f"[{index}/6] {stage}: skipped" in out
    assert out.count("speculative decoding on ") == 1
    # The first run's stage times are kept in the history, not overwritten.
    assert [h["stages"] for h in summary2["history"]] == [summary["stages"]]
    assert (run_dir / "checkpoints" / "step_00000006" / "model.safetensors").read_bytes() == weights
    assert json.loads((run_dir / "eval" / "report.json").read_text())["created"] == report["created"]
    monkeypatch.undo()

    # A changed data setting reruns prepare, says why in one line, and then the dump behind it is stale.
    original, changed = load_recipe(recipe), load_recipe(recipe, ["data.max_length=80"])
    verdict = stages.check("prepare", changed)
    assert not verdict.current and verdict.reason == "data.max_length changed (96 -> 80)"
    assert stages.check("dump", changed).current  # its input, the prepared data, is still the old one
    from eyas.data.prepare import main as prepare_main

    changed = load_recipe(recipe, ["data.max_length=80", "data.regenerate=false"])  # no regeneration: quick
    assert prepare_main([str(recipe), "data.max_length=80", "data.regenerate=false"]) == 0
    assert ("eyas prepare: running again: data.max_length changed (96 -> 80); data.regenerate changed (True -> False)"
            in capsys.readouterr().out)
    assert stages.check("prepare", changed).current
    dump_verdict = stages.check("dump", changed)
    assert not dump_verdict.current and dump_verdict.reason == "the prepare output it reads has changed"
    assert not stages.check("prepare", original).current


CHAT_QUESTIONS = ("Hi! How was your weekend?", "What kind of music do you like?", "Do you have any pets?",
                  "What did you have for dinner last night?")


@pytest.mark.serving
def test_the_quickstarts_vllm_line_serves_the_draft(parity_drafts, tmp_path):
    """The quickstart's last lines name a vLLM command that runs as printed on this CPU (a free port added): the
    real SmolLM2 target from eyas's cache and the exported eagle3 draft of the vLLM tests. The server answers greedy
    chat turns and its metrics count drafted tokens accepted, so the draft is the one serving."""
    import subprocess
    import time
    import urllib.request

    from eyas.eval.engine_vllm import free_port, stop_process

    recipe = load_recipe(quickstart.packaged_recipe(), [f"run.output_dir={tmp_path}", "target.dtype=float32",
                                                        f"eval.checkpoint={parity_drafts['eagle3']}"])
    session = quickstart.Session(recipe, False, quickstart.Target(recipe))
    lines = quickstart.serve_lines(recipe, quickstart._export(session))
    assert [line.split(",")[0] for line in lines] == ["vLLM", "SGLang"]
    command = lines[0].split(": ", 1)[1]
    port = free_port()
    log = tmp_path / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        server = subprocess.Popen(["bash", "-c", f"{command} --host 127.0.0.1 --port {port}"], stdout=out,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _answers(f"{url}/v1/models"):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(2)
        model = str(resolve_target_path("smollm2-135m-instruct").resolve())
        for question in CHAT_QUESTIONS:  # chat turns, as the draft was trained on (chitchat replies)
            body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 48,
                               "temperature": 0}).encode()
            request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                assert json.loads(response.read())["choices"][0]["message"]["content"]
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            metrics = response.read().decode()
    finally:
        stop_process(server)
    counted = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:spec_decode_num_")}
    assert counted.get("vllm:spec_decode_num_draft_tokens_total", 0) > 0, counted
    assert counted.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, counted


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False
