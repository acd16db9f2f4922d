"""The training loop on a tiny target with real shards: resume exactness, kinds, online source,
refusals, NaN stop, best/last checkpoints, loggers. Multi-process runs are in test_train_distributed.py."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import make_workspace, new_run

from eyas.config import load_recipe
from eyas.draft.checkpoint import load_draft
from eyas.errors import EyasError
from eyas.shapes import parse_shape, simulated_acceptance
from eyas.train.checkpoint import list_checkpoints
from eyas.train.data import check_shards_fit
from eyas.train.loop import train

ROWS = 48


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_llama_dir):
    """48 chitchat conversations prepared and dumped (bf16, eagle3 layers + last hidden) once."""
    return make_workspace(tmp_path_factory.mktemp("trainloop"), tiny_llama_dir, ROWS)


def _base(root: Path, target: Path) -> list[str]:
    return [f"target.path={target}", f"run.output_dir={root}", "dump.draft_vocab_size=128"]


def _recipe(ws, name: str, *extra: str):
    """A fresh run `name` sharing the workspace's shards and prepared data."""
    new_run(ws, name)
    return _same(ws, name, *extra)


def _same(ws, name: str, *extra: str):
    """The recipe of an existing run (to resume it)."""
    return load_recipe(None, _base(ws["root"], ws["target"]) + [
        f"run.name={name}", "train.token_budget=400", "train.max_steps=6", "train.ttt_steps=3",
        "train.save_every=2", "train.eval_every=3", "train.eval_batches=2", "train.log_every=1",
        "train.warmup_steps=2", "train.lr=1e-3", *extra])


def _weights(checkpoint: Path) -> dict:
    return load_file(str(checkpoint / "model.safetensors"))


def _train_log(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_killed_and_resumed_equals_uninterrupted(workspace):
    full = train(_recipe(workspace, "uninterrupted"))
    assert full["outcome"] == "done" and full["step"] == 6
    first = train(_recipe(workspace, "killed"), stop_at_step=3)
    assert first["outcome"] == "stop_at_step" and first["step"] == 3
    assert [p.name for p in list_checkpoints(workspace["root"] / "killed" / "checkpoints")] == \
        ["step_00000002", "step_00000003"]
    second = train(_same(workspace, "killed"))
    assert second["step"] == 6
    steps = [r["step"] for r in _train_log(workspace["root"] / "killed")]
    assert steps == [1, 2, 3, 4, 5, 6]  # the second run started at step 4: it resumed
    a, b = _weights(full["checkpoint"]), _weights(second["checkpoint"])
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the resumed run logged the same losses as the uninterrupted one
    assert [r["loss"] for r in _train_log(workspace["root"] / "killed")] == \
        [r["loss"] for r in _train_log(workspace["root"] / "uninterrupted")]


def test_best_and_last_checkpoints(workspace):
    result = train(_recipe(workspace, "keep", "train.max_steps=7", "train.eval_every=2", "train.keep_last=2"))
    ckpts = workspace["root"] / "keep" / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000006", "step_00000007"]
    evals = _train_log(workspace["root"] / "keep", "eval")
    assert [e["step"] for e in evals] == [2, 4, 6, 7]
    best = max(evals, key=lambda e: e["sim_accept"])
    head, meta = load_draft(ckpts / "best")
    assert meta["step"] == best["step"] and meta["eval"]["sim_accept"] == pytest.approx(best["sim_accept"])
    assert result["best_score"] == pytest.approx(best["sim_accept"]) and result["best_by"] == "chain:5"
    # chosen for the first of eval.shapes, chain:5, whose figure over the 3 unrolled steps is the chain figure
    assert meta["selected_by"] == {"shape": "chain:5", "simulated_acceptance": pytest.approx(best["sim_accept"]),
                                   "on": "heldout"}
    for e in evals:  # simulated acceptance is the sum of running products of the step accuracies
        run, total = 1.0, 0.0
        for k in range(3):
            run *= e[f"acc_{k}"]
            total += run
        assert e["sim_accept"] == pytest.approx(total)
        # the rank-0 share of every step (the target's token ranked first by the draft) is its accuracy
        assert e["select_shape"] == "chain:5" and e["select_accept"] == pytest.approx(e["sim_accept"])
    assert head.kind == "eagle3" and head.d2t is not None and head.lm_head.weight.shape[0] == 128


def test_best_is_chosen_for_the_tree_it_serves(workspace):
    """train.select_shape names a tree: best/ is the checkpoint whose held-out simulated acceptance of that tree
    is highest, recorded in its meta; the figure is the tree's under the logged rank rates (measured along the
    branch the tree continues, each depth's over the positions the branch reached; its first depth is the chain's
    step 0), above the chain's where the target's token is the draft's second choice often enough."""
    tree = "dynamic:depth=3,topk=2,nodes=4"
    result = train(_recipe(workspace, "tree", "train.max_steps=7", "train.eval_every=2",
                           f"train.select_shape={tree}"))
    evals = _train_log(workspace["root"] / "tree", "eval")
    best = max(evals, key=lambda e: e["select_accept"])
    _, meta = load_draft(workspace["root"] / "tree" / "checkpoints" / "best")
    assert meta["step"] == best["step"] and result["best_by"] == tree
    assert meta["selected_by"] == {"shape": tree, "simulated_acceptance": pytest.approx(best["select_accept"]),
                                   "on": "heldout"}
    for e in evals:
        rates = [[e[f"rank_rate_{k}_{r}"] for r in range(2)] for k in range(3)]
        assert e["select_shape"] == tree
        assert e["select_accept"] == pytest.approx(simulated_acceptance(parse_shape(tree), rates))
        assert rates[0][0] == pytest.approx(e["acc_0"])
        assert e["reach_0"] == pytest.approx(1.0) and 0.0 < e["reach_2"] <= e["reach_1"] < 1.0  # the rates' positions
    assert any(e["select_accept"] > e["sim_accept"] + 1e-3 for e in evals)
    with pytest.raises(EyasError, match="recipe key 'train.select_shape': unknown draft shape 'chain'"):
        _recipe(workspace, "bad", "train.select_shape=chain")


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_other_kinds_train(workspace, kind):
    result = train(_recipe(workspace, f"kind_{kind}", f"draft.kind={kind}", "draft.num_steps=3",
                           "train.max_steps=8", "train.eval_every=0"))
    losses = [r["loss"] for r in _train_log(workspace["root"] / f"kind_{kind}")]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0]
    head, _ = load_draft(result["checkpoint"])
    assert head.kind == kind
    # EAGLE-1 keeps the target's full head; mtp predicts over the dump's reduced vocabulary (frozen rows)
    assert (head.d2t is None, head.lm_head.weight.shape[0]) == ((True, 384) if kind == "eagle" else (False, 128))
    if kind == "eagle":
        assert "feature_loss" in _train_log(workspace["root"] / "kind_eagle")[0]


def test_online_source_matches_shards(workspace):
    """One batch holding every sample: online features = dumped bf16 features up to rounding."""
    common = ("train.max_steps=1", "train.token_budget=5000", "train.eval_every=0", "train.save_every=0")
    shards = train(_recipe(workspace, "from_shards", *common))
    online = train(_recipe(workspace, "online", "train.source=online", *common))
    a = _train_log(workspace["root"] / "from_shards")[0]
    b = _train_log(workspace["root"] / "online")[0]
    assert a["tokens"] == b["tokens"]
    assert b["loss"] == pytest.approx(a["loss"], rel=2e-3)
    assert shards["step"] == online["step"] == 1


def test_nan_loss_stops_with_step_batch_and_checkpoint(workspace, monkeypatch):
    from eyas.train import losses

    real = losses.Teacher.distribution
    calls = {"n": 0}

    def poisoned(self, last_hidden):
        calls["n"] += 1
        out = real(self, last_hidden)
        if calls["n"] == 4:
            out.probs[0, 5] = float("nan")  # one position of the 4th batch
        return out

    monkeypatch.setattr(losses.Teacher, "distribution", poisoned)
    with pytest.raises(EyasError) as err:
        train(_recipe(workspace, "nan", "train.eval_every=0"))
    message = str(err.value)
    assert "non-finite loss at step 4" in message and "data epoch 0 batch 4" in message
    assert "step_00000002" in message  # the last good checkpoint (saved every 2 steps)


def test_micro_batches_add_no_host_sync(workspace, monkeypatch):
    """The finiteness check is one all-reduce (and one read on the host) per optimizer step, not one per micro-batch:
    a run of train.grad_accum=3 makes as many all-reduces as the same run of 1."""
    from accelerate import Accelerator

    real, calls = Accelerator.reduce, []
    monkeypatch.setattr(Accelerator, "reduce", lambda self, *args, **kwargs: calls.append(1) or real(self, *args, **kwargs))
    counted = {}
    for accum in (1, 3):
        calls.clear()
        train(_recipe(workspace, f"accum-{accum}", f"train.grad_accum={accum}", "train.max_steps=2"))
        counted[accum] = len(calls)
    assert counted[3] == counted[1], counted


def test_a_step_that_is_not_logged_leaves_its_sums_on_the_device(workspace, monkeypatch):
    """A step's losses, accuracies, counts and tokens stay on the device until a log step reads them (one
    collective for the sums, one for the tokens since the last read): a step that is not logged makes two
    all-reduces fewer, and the checkpoint counts the same tokens as a run that logs every step."""
    from accelerate import Accelerator

    from eyas.train.checkpoint import read_trainer_state

    real, calls = Accelerator.reduce, []
    monkeypatch.setattr(Accelerator, "reduce", lambda self, *args, **kwargs: calls.append(1) or real(self, *args, **kwargs))
    counted, tokens = {}, {}
    for every in (1, 3):
        calls.clear()
        result = train(_recipe(workspace, f"log-every-{every}", f"train.log_every={every}", "train.save_every=0",
                               "train.eval_every=0"))
        counted[every] = len(calls)
        tokens[every] = read_trainer_state(result["checkpoint"])["tokens"]
    assert counted[1] - counted[3] == 2 * 4, counted  # steps 1, 2, 4 and 5 of 6 are not logged at every=3
    assert tokens[1] == tokens[3] == sum(r["tokens"] for r in _train_log(workspace["root"] / "log-every-1")) > 0


def test_refuses_shards_that_do_not_fit(workspace):
    manifest = json.loads((workspace["root"] / "base" / "shards" / "manifest.json").read_text())
    layers = check_shards_fit(manifest, "eagle3", 64, [], Path("x"))
    assert layers == manifest["layers"]
    with pytest.raises(EyasError, match="hold hidden size 64, the target has 32"):
        check_shards_fit(manifest, "eagle3", 32, [], Path("x"))
    with pytest.raises(EyasError, match=r"recipe dump.layers is \[1, 2, 3\]"):
        check_shards_fit(manifest, "eagle3", 64, [1, 2, 3], Path("x"))
    no_aux = dict(manifest, features={k: v for k, v in manifest["features"].items() if k != "aux_hidden"})
    no_aux["draft_kind"] = "eagle"
    with pytest.raises(EyasError, match="eagle3 needs the three fused layers"):
        check_shards_fit(no_aux, "eagle3", 64, [], Path("x"))
    assert check_shards_fit(no_aux, "mtp", 64, [], Path("x")) == manifest["layers"]
    # end to end: a run whose shards lack the layers stops before any step
    run = workspace["root"] / "misfit"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(workspace["root"] / "base" / "shards", run / "shards")
    (run / "shards" / "manifest.json").write_text(json.dumps(no_aux))
    with pytest.raises(EyasError, match="eagle3 needs the three fused layers"):
        train(_same(workspace, "misfit"))
    assert not (run / "checkpoints").exists()


def test_incompatible_resume_says_what_differs(workspace):
    train(_recipe(workspace, "changed", "train.max_steps=2", "train.eval_every=0"))
    with pytest.raises(EyasError, match="intermediate_size: checkpoint 128 vs this run 32"):
        train(_same(workspace, "changed", "train.max_steps=4", "draft.intermediate_size=32"))
    fresh = train(_same(workspace, "changed", "train.max_steps=2", "draft.intermediate_size=32",
                        "train.resume=false", "train.eval_every=0"))
    assert fresh["step"] == 2


@pytest.mark.parametrize("logger", ["wandb", "tensorboard"])
def test_logger_files_written(workspace, logger, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    train(_recipe(workspace, f"log_{logger}", f"train.logger={logger}", "train.max_steps=2", "train.eval_every=0"))
    logs = workspace["root"] / f"log_{logger}" / "logs"
    if logger == "wandb":
        runs = list((logs / "wandb").glob("offline-run-*"))
        assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    else:
        assert list((logs / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(_train_log(workspace["root"] / f"log_{logger}")) == 2


def test_resume_applies_a_changed_learning_rate(workspace, capsys):
    """A resume with train.lr changed trains at the new rate from the resumed step on, and says so."""
    train(_recipe(workspace, "lr-changed"), stop_at_step=3)
    resumed = train(_same(workspace, "lr-changed", "train.lr=1e-5"))
    assert resumed["step"] == 6
    assert "train.lr 0.001 -> 1e-05" in capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in _train_log(workspace["root"] / "lr-changed")}
    reference = {r["step"]: r["lr"] for r in _train_log(workspace["root"] / "uninterrupted")} or None
    if reference is None:  # this test alone: an uninterrupted run at lr 1e-3 for the schedule's factors
        train(_recipe(workspace, "uninterrupted"))
        reference = {r["step"]: r["lr"] for r in _train_log(workspace["root"] / "uninterrupted")}
    for step in (1, 2, 3):
        assert lrs[step] == pytest.approx(reference[step])
    for step in (4, 5, 6):  # the same schedule factor, on the new peak
        assert lrs[step] == pytest.approx(reference[step] * 1e-2)
    saved = json.loads((resumed["checkpoint"] / "trainer.json").read_text())
    assert saved["train"]["lr"] == 1e-5  # recorded as applied


def test_a_resume_choosing_for_another_shape_replaces_best_at_its_next_eval(workspace, capsys):
    """best/ chosen for chain:5 before the stop; resumed with train.select_shape naming a tree, the trainer says so
    and the next held-out eval chooses best/ for the tree, whatever the chain figure was."""
    tree = "dynamic:depth=3,topk=2,nodes=4"
    train(_recipe(workspace, "reselect"), stop_at_step=3)
    _, before = load_draft(workspace["root"] / "reselect" / "checkpoints" / "best")
    assert before["step"] == 3 and before["selected_by"]["shape"] == "chain:5"
    resumed = train(_same(workspace, "reselect", f"train.select_shape={tree}"))
    assert ("best/ was chosen by the simulated acceptance of chain:5; the next held-out eval chooses by "
            f"{tree} (train.select_shape)") in capsys.readouterr().out
    _, after = load_draft(workspace["root"] / "reselect" / "checkpoints" / "best")
    last = _train_log(workspace["root"] / "reselect", "eval")[-1]
    assert after["step"] == last["step"] == 6 and resumed["best_by"] == tree
    assert after["selected_by"]["simulated_acceptance"] == pytest.approx(last["select_accept"])


def test_resume_refuses_a_setting_it_cannot_apply(workspace):
    train(_recipe(workspace, "budget-changed"), stop_at_step=2)
    with pytest.raises(EyasError, match=r"train\.token_budget was 400, now 600.*train\.resume=false"):
        train(_same(workspace, "budget-changed", "train.token_budget=600"))


def test_resume_keeps_the_checkpoints_global_batch(workspace, capsys):
    """A recipe whose train.grad_accum is not the checkpoint's (a run resized earlier, or an edit) resumes
    with the checkpoint's, says so in one line, and ends bitwise equal to the uninterrupted run."""
    full = train(_recipe(workspace, "accum-reference"))
    train(_recipe(workspace, "accum-changed"), stop_at_step=2)
    resumed = train(_same(workspace, "accum-changed", "train.grad_accum=3"))
    assert "resuming 1 -> 1 process(es): train.grad_accum 3 -> 1 keeps the checkpoint's global batch" in capsys.readouterr().out
    assert [r["tokens"] for r in _train_log(workspace["root"] / "accum-changed")] == \
        [r["tokens"] for r in _train_log(workspace["root"] / "accum-reference")]
    a, b = _weights(full["checkpoint"]), _weights(resumed["checkpoint"])
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_steps_redone_after_a_kill_are_logged_once(workspace):
    """metrics.jsonl rows of steps past the last checkpoint (lost in a kill) are dropped on resume."""
    run = workspace["root"] / "redone"
    train(_recipe(workspace, "redone"), stop_at_step=3)
    log = run / "logs" / "metrics.jsonl"
    shutil.rmtree(run / "checkpoints" / "step_00000003")  # as if killed after logging step 3, before saving it
    with log.open("a") as f:
        f.write('{"kind": "train", "step": 3, "loss": 1.0')  # and a torn line
    train(_same(workspace, "redone"))
    assert [r["step"] for r in _train_log(run)] == [1, 2, 3, 4, 5, 6]


def test_damaged_random_state_is_refused(workspace):
    """A resume that could not restore the RNG would silently stop being exact: refuse it."""
    train(_recipe(workspace, "rng-damaged"), stop_at_step=2)
    rng = workspace["root"] / "rng-damaged" / "checkpoints" / "step_00000002" / "state" / "random_states_0.pkl"
    data = bytearray(rng.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rng.write_bytes(bytes(data))
    with pytest.raises(EyasError, match="random state of rank 0 .* damaged"):
        train(_same(workspace, "rng-damaged"))


def _random_state(checkpoint: Path) -> dict:
    # accelerate pickles it; this is the file the test's own run just wrote
    return torch.load(checkpoint / "state" / "random_states_0.pkl", weights_only=False)


def test_resumed_run_ends_with_the_uninterrupted_random_state(workspace):
    """The loader's workers are seeded from a generator of their own: starting them after a resume
    must not draw from the global RNG the resume restored (a resumed run was one draw ahead)."""
    full = train(_recipe(workspace, "rng-whole"))
    train(_recipe(workspace, "rng-cut"), stop_at_step=3)
    resumed = train(_same(workspace, "rng-cut"))
    want, got = _random_state(full["checkpoint"]), _random_state(resumed["checkpoint"])
    assert want.keys() == got.keys()
    assert torch.equal(got["torch_manual_seed"], want["torch_manual_seed"])
    for key in want.keys() - {"torch_manual_seed"}:  # python's and numpy's states, accelerate's counter
        assert pickle.dumps(got[key]) == pickle.dumps(want[key]), key


def test_full_disk_during_a_save_is_one_clear_error(workspace, monkeypatch):
    import errno

    import eyas.train.loop as loop

    train(_recipe(workspace, "disk-full"), stop_at_step=2)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loop, "save_draft", no_space)
    with pytest.raises(EyasError, match=r"No space left on device.*step_00000002.*free disk space"):
        train(_same(workspace, "disk-full"))
    ckpts = workspace["root"] / "disk-full" / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000002"]
    assert not list(ckpts.glob("*.partial"))


def _target_layer(target_dir: Path) -> tuple[int, dict]:
    """The tiny target's last decoder layer, named as inside the layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    last = model.config.num_hidden_layers - 1
    return last, {k: v for k, v in model.model.layers[last].state_dict().items()}


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_draft_init_from_the_targets_last_layer(workspace, kind, capsys):
    from eyas.train.loop import Trainer

    last, layer = _target_layer(workspace["target"])
    recipe = _recipe(workspace, f"init_{kind}", f"draft.kind={kind}", "train.draft_init=target_last_layer")
    head = Trainer(recipe).setup.model.head
    blocks = [head.midlayer] if kind == "eagle3" else list(head.layers)
    hidden = layer["self_attn.o_proj.weight"].shape[0]
    for block in blocks:
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
                     "post_attention_layernorm.weight", "input_layernorm.weight"):
            assert torch.equal(block.get_parameter(name), layer[name]), name
        q = block.self_attn.q_proj.weight
        if kind == "eagle3":  # reads concat(embedding, feature): the target's q in the feature half only
            assert torch.equal(q[:, hidden:], layer["self_attn.q_proj.weight"])
            assert not torch.equal(q[:, :hidden], layer["self_attn.q_proj.weight"])
            assert torch.equal(block.hidden_norm.weight, layer["input_layernorm.weight"])
        else:
            assert torch.equal(q, layer["self_attn.q_proj.weight"])
    random = _recipe(workspace, f"rand_{kind}", f"draft.kind={kind}")
    trainer = Trainer(random)
    # the schedule drives the optimizer accelerate prepared (FSDP and ZeRO put their own parameters in its
    # groups), not the one built before `prepare`
    assert trainer.setup.scheduler.optimizer is trainer.setup.optimizer
    other = trainer.setup.model.head
    o_proj = (other.midlayer if kind == "eagle3" else other.layers[0]).self_attn.o_proj.weight
    assert not torch.equal(o_proj, layer["self_attn.o_proj.weight"])  # the default is still the random init
    result = train(recipe)
    assert result["outcome"] == "done"
    assert f"from target layer {last}" in capsys.readouterr().out  # said in the run's first line


def test_resume_refuses_a_changed_draft_init(workspace):
    train(_recipe(workspace, "init-changed"), stop_at_step=2)
    with pytest.raises(EyasError, match=r"train\.draft_init was 'random', now 'target_last_layer'"):
        train(_same(workspace, "init-changed", "train.draft_init=target_last_layer"))


def test_ttt_ramp_starts_shallow_and_resumes_exactly(workspace):
    ramp = ("train.ttt_ramp_steps=4",)  # ttt_steps 3: depth 1 + 3s // 4 at 0-based step s
    full = train(_recipe(workspace, "ramp-full", *ramp))
    rows = _train_log(workspace["root"] / "ramp-full")
    assert [r.get("ttt_depth", 3) for r in rows] == [1, 1, 2, 3, 3, 3]
    assert ["loss_1" in r for r in rows] == [False, False, True, True, True, True]
    assert "loss_2" in rows[-1] and "loss_2" not in rows[2]
    train(_recipe(workspace, "ramp-killed", *ramp), stop_at_step=2)
    resumed = train(_same(workspace, "ramp-killed", *ramp))
    a, b = _weights(full["checkpoint"]), _weights(resumed["checkpoint"])
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [r["loss"] for r in _train_log(workspace["root"] / "ramp-killed")] == [r["loss"] for r in rows]


def test_target_layer_is_the_same_from_the_files_and_from_a_loaded_model(tiny_llama_dir):
    from eyas.train.data import read_target_layer

    last, layer = _target_layer(tiny_llama_dir)
    from_files = read_target_layer(str(tiny_llama_dir))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    from_model = read_target_layer(str(tiny_llama_dir), target_model=model)  # the online source's path
    for index, tensors in (from_files, from_model):
        assert index == last and tensors.keys() == layer.keys()
        assert all(torch.equal(tensors[k], layer[k]) for k in layer)


def test_a_run_pinned_to_some_cpus_trains_with_a_thread_for_each_of_them(tmp_path):
    """A SLURM task's cpuset, a container or `taskset` (CI pins each test lane to one core) limits where a process
    runs; the trainer counts those CPUs, not the machine's, so it starts no threads that would spin against each
    other on one core (eyas.cpus)."""
    import os

    from eyas.train.accelerator import make_accelerator

    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    recipe = load_recipe(None, [f"run.output_dir={tmp_path}"])
    try:
        os.sched_setaffinity(0, {min(allowed)})
        make_accelerator(recipe, find_unused=False)
        assert torch.get_num_threads() == 1
        os.sched_setaffinity(0, allowed)
        make_accelerator(recipe, find_unused=False)
        assert torch.get_num_threads() == len(allowed)
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
