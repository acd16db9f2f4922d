"""Training state eyas loads only if it wrote it (eyas.train.trust): a keyed digest beside every
checkpoint's state, checked before anything is unpickled; `train.trust_checkpoint` accepts one.

Every test points the key at a file of its own (EYAS_CHECKPOINT_KEY_FILE), never the real home."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import make_workspace, new_run

from eyas.config import load_recipe
from eyas.errors import EyasError
from eyas.io import sha256_file
from eyas.train import trust
from eyas.train.loop import train
from eyas.train.rank_zero import RankZeroWork


@pytest.fixture(autouse=True)
def key_file(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "keys" / "mine.key"
    monkeypatch.setenv(trust.KEY_ENV, str(path))
    return path


# ----------------------------------------------------------------------------- a checkpoint on disk


def _fake_checkpoint(root: Path) -> Path:
    """The files a resume reads, in the layout eyas writes (contents arbitrary: nothing here loads them)."""
    checkpoint = root / "checkpoints" / "step_00000004"
    (checkpoint / "state" / "pytorch_model").mkdir(parents=True)
    (checkpoint / "state" / "model.safetensors").write_bytes(os.urandom(3000))
    (checkpoint / "state" / "optimizer.bin").write_bytes(os.urandom(5000))
    (checkpoint / "state" / "random_states_0.pkl").write_bytes(os.urandom(400))
    (checkpoint / "state" / "pytorch_model" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(2 << 20))
    (checkpoint / "trainer.json").write_text(json.dumps({"step": 4}))
    (checkpoint / "loader_rank0.json").write_text(json.dumps({"epoch": 0, "batch": 4}))
    (checkpoint / "model.safetensors").write_bytes(b"draft weights: not training state")
    return checkpoint


def _flip_a_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def test_sign_then_verify_passes_and_the_key_is_private(tmp_path, key_file):
    checkpoint = _fake_checkpoint(tmp_path)
    trust.sign_checkpoint(checkpoint)
    assert trust.refusal(checkpoint) is None
    signed = json.loads((checkpoint / trust.DIGEST_FILE).read_text())
    assert [e["path"] for e in signed["files"]] == [
        "loader_rank0.json", "state/model.safetensors", "state/optimizer.bin",
        "state/pytorch_model/mp_rank_00_model_states.pt", "state/random_states_0.pkl", "trainer.json"]
    assert len(key_file.read_bytes()) == trust.KEY_BYTES
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert list(key_file.parent.iterdir()) == [key_file]  # no temporary left behind


@pytest.mark.parametrize("victim", ["state/pytorch_model/mp_rank_00_model_states.pt", "state/random_states_0.pkl",
                                    "trainer.json", "loader_rank0.json"])
def test_a_changed_byte_is_refused_naming_the_file(tmp_path, victim):
    checkpoint = _fake_checkpoint(tmp_path)
    trust.sign_checkpoint(checkpoint)
    _flip_a_byte(checkpoint / victim)
    reason = trust.refusal(checkpoint)
    assert f"its files differ from what eyas signed: {victim} (changed)" in reason
    assert f"'{checkpoint}'" in reason and f"train.trust_checkpoint={checkpoint.resolve()}" in reason
    assert "\n" not in reason


def test_the_draft_files_beside_the_state_are_not_what_a_resume_reads(tmp_path):
    """model.safetensors/config.json at the top are safetensors and JSON for eval and export; not signed."""
    checkpoint = _fake_checkpoint(tmp_path)
    trust.sign_checkpoint(checkpoint)
    _flip_a_byte(checkpoint / "model.safetensors")
    assert trust.refusal(checkpoint) is None


@pytest.mark.parametrize("change, named", [
    (lambda c: (c / "state" / "custom_checkpoint_0.pkl").write_bytes(b"x"), "state/custom_checkpoint_0.pkl (added)"),
    (lambda c: (c / "loader_rank1.json").write_text("{}"), "loader_rank1.json (added)"),
    (lambda c: (c / "state" / "optimizer.bin").unlink(), "state/optimizer.bin (removed)"),
    (lambda c: (c / "state" / "optimizer.bin").write_bytes(b"short"), "state/optimizer.bin (size changed)"),
    (lambda c: (c / "state" / "extra").symlink_to(c.parent), "state/extra (a link or special file)"),
])
def test_a_file_added_removed_or_linked_is_refused(tmp_path, change, named):
    checkpoint = _fake_checkpoint(tmp_path)
    trust.sign_checkpoint(checkpoint)
    change(checkpoint)
    assert named in trust.refusal(checkpoint)


def test_an_edited_digest_file_or_another_users_key_is_refused(tmp_path, monkeypatch):
    checkpoint = _fake_checkpoint(tmp_path)
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "other-user.key"))
    trust.sign_checkpoint(checkpoint)
    assert trust.refusal(checkpoint) is None  # valid for the user who signed it
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "mine.key"))
    assert "was not made with your key" in trust.refusal(checkpoint)
    # an attacker who rewrites the listing to match a changed file cannot make its digest
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "other-user.key"))
    _flip_a_byte(checkpoint / "trainer.json")
    signed = json.loads((checkpoint / trust.DIGEST_FILE).read_text())
    signed["files"] = [e for e in signed["files"] if e["path"] != "trainer.json"]
    (checkpoint / trust.DIGEST_FILE).write_text(json.dumps(signed))
    assert "was not made with your key" in trust.refusal(checkpoint)


@pytest.mark.parametrize("digest", [None, "not json", '{"format": "eyas-checkpoint-hmac/1", "files": 3}'])
def test_no_or_a_broken_digest_file_is_refused_and_accepting_it_takes_its_path(tmp_path, digest, monkeypatch):
    checkpoint = _fake_checkpoint(tmp_path)  # as written before eyas signed checkpoints
    if digest is not None:
        (checkpoint / trust.DIGEST_FILE).write_text(digest)
    reason = trust.refusal(checkpoint)
    assert ("has no state.hmac" if digest is None else "is not a digest file eyas wrote") in reason
    assert f"train.trust_checkpoint={checkpoint.resolve()}" in reason
    monkeypatch.chdir(tmp_path)
    assert trust.refusal(checkpoint, "checkpoints/step_00000004/") is None  # relative to the working directory
    other = tmp_path / "checkpoints" / "step_00000002"
    assert "train.trust_checkpoint names" in trust.refusal(checkpoint, str(other))


def test_verify_before_load_raises_one_line(tmp_path):
    class OneProcess:
        is_main_process, num_processes, process_index = True, 1, 0

    checkpoint = _fake_checkpoint(tmp_path)
    rank_zero = RankZeroWork(OneProcess(), timeout_s=60)
    with pytest.raises(EyasError, match=r"^refusing to resume from .*has no state\.hmac[^\n]*$"):
        trust.verify_before_load(rank_zero, checkpoint)
    trust.sign_checkpoint(checkpoint)
    trust.verify_before_load(rank_zero, checkpoint)
    assert set(rank_zero.seconds) == {"check of the checkpoint's digest"}  # measured


def test_racing_creators_end_with_one_key(key_file):
    barrier = threading.Barrier(8)
    keys: list[bytes] = []

    def make() -> None:
        barrier.wait()
        keys.append(trust.load_key())

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and set(keys) == {key_file.read_bytes()}
    # the loser of the race (its link finds the winner's key in place) takes the winner's key
    assert trust._create_key(key_file) == key_file.read_bytes()
    assert list(key_file.parent.iterdir()) == [key_file]


def test_a_short_or_unwritable_key_is_one_clear_error(tmp_path, monkeypatch, key_file):
    key_file.parent.mkdir(parents=True)
    key_file.write_bytes(b"too short")
    with pytest.raises(EyasError, match="holds 9 bytes, fewer than 32.*EYAS_CHECKPOINT_KEY_FILE"):
        trust.load_key()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(trust.KEY_ENV, str(blocker / "checkpoint.key"))
    with pytest.raises(EyasError, match="cannot read the checkpoint key .*EYAS_CHECKPOINT_KEY_FILE"):
        trust.load_key()
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "read-only" / "checkpoint.key"))

    def read_only_filesystem(*args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(trust.os, "link", read_only_filesystem)
    with pytest.raises(EyasError, match="cannot create the checkpoint key .*Read-only file system.*EYAS_CHECKPOINT_KEY_FILE"):
        trust.load_key()
    assert list((tmp_path / "read-only").iterdir()) == []  # its temporary is gone


def test_default_key_lives_in_the_user_config_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(trust.KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert trust.key_path() == tmp_path / "cfg" / "eyas" / "checkpoint.key"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert trust.key_path() == Path.home() / ".config" / "eyas" / "checkpoint.key"


# ----------------------------------------------------------------------------- through the trainer


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_llama_dir):
    return make_workspace(tmp_path_factory.mktemp("traintrust"), tiny_llama_dir, 48)


def _same(ws, name: str, *extra: str):
    return load_recipe(None, [
        f"target.path={ws['target']}", f"run.output_dir={ws['root']}", "dump.draft_vocab_size=128", f"run.name={name}",
        "train.token_budget=400", "train.max_steps=6", "train.ttt_steps=3", "train.save_every=3", "train.eval_every=0",
        "train.eval_batches=2", "train.log_every=1", "train.warmup_steps=2", "train.lr=1e-3", *extra])


def _fresh(ws, name: str, *extra: str):
    new_run(ws, name)
    return _same(ws, name, *extra)


@pytest.fixture(scope="module")
def uninterrupted(workspace, tmp_path_factory) -> dict:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(trust.KEY_ENV, str(tmp_path_factory.mktemp("key") / "k"))
        result = train(_fresh(workspace, "uninterrupted"))
    assert result["step"] == 6
    return load_file(str(result["checkpoint"] / "model.safetensors"))


def _assert_same_weights(expected: dict, checkpoint: Path) -> None:
    got = load_file(str(checkpoint / "model.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_a_resume_with_the_digest_in_place_is_bitwise_equal(workspace, uninterrupted):
    first = train(_fresh(workspace, "signed"), stop_at_step=3)
    checkpoint = first["checkpoint"]
    assert (checkpoint / trust.DIGEST_FILE).is_file() and trust.refusal(checkpoint) is None
    resumed = train(_same(workspace, "signed"))
    assert resumed["step"] == 6
    _assert_same_weights(uninterrupted, resumed["checkpoint"])
    assert trust.refusal(resumed["checkpoint"]) is None


class _TouchOnLoad:
    """A pickle that, when unpickled without restrictions (DeepSpeed's torch.load(weights_only=False)),
    creates a file: stands in for any code a crafted checkpoint would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_state_stops_the_resume_before_anything_is_unpickled(workspace, tmp_path, monkeypatch):
    from accelerate import Accelerator
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    checkpoint = train(_fresh(workspace, "crafted"), stop_at_step=3)["checkpoint"]
    marker = tmp_path / "code-ran"
    crafted = checkpoint / "state" / "random_states_0.pkl"
    torch.save({"payload": _TouchOnLoad(str(marker))}, crafted)
    # as an attacker would, also fix up the RNG checksum eyas recorded (it is not keyed)
    position = checkpoint / "loader_rank0.json"
    position.write_text(json.dumps({**json.loads(position.read_text()), "rng_sha256": sha256_file(crafted)}))

    unpickled: list[str] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: unpickled.append(str(f)) or real_load(f, *a, **k))
    monkeypatch.setattr(Accelerator, "load_state", lambda self, *a, **k: unpickled.append("load_state"))
    with pytest.raises(EyasError) as refused:
        train(_same(workspace, "crafted"))
    message = str(refused.value)
    assert "\n" not in message and f"refusing to resume from '{checkpoint}'" in message
    assert "state/random_states_0.pkl (size changed)" in message and "train.trust_checkpoint=" in message
    assert unpickled == [] and not marker.exists()
    monkeypatch.setattr(torch, "load", real_load)
    # the control: DeepSpeed's own loader runs the crafted file's code
    copy = tmp_path / "copy.pkl"
    shutil.copy(crafted, copy)
    TorchCheckpointEngine().load(str(copy))
    assert marker.exists()


def test_another_users_checkpoint_is_refused_then_accepted_and_resumes_exactly(
        workspace, uninterrupted, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "colleague.key"))
    checkpoint = train(_fresh(workspace, "copied"), stop_at_step=3)["checkpoint"]
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "mine.key"))
    with pytest.raises(EyasError, match="refusing to resume .*was not made with your key.*train.trust_checkpoint="):
        train(_same(workspace, "copied"))
    resumed = train(_same(workspace, "copied", f"train.trust_checkpoint={checkpoint}"))
    assert resumed["step"] == 6
    assert "without checking its digest (train.trust_checkpoint accepts it)" in capsys.readouterr().out
    _assert_same_weights(uninterrupted, resumed["checkpoint"])
    assert trust.refusal(resumed["checkpoint"]) is None  # the next save signed it with this user's key


# ----------------------------------------------------------------------------- DeepSpeed, two processes

REPO = Path(__file__).resolve().parents[1]


def _launch_zero2(recipe: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(["accelerate", "launch", "--config_file", str(REPO / "recipes/accelerate/deepspeed_zero2.yaml"),
                           "--num_processes", "2", "-m", "eyas.train", str(recipe), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.cluster
def test_deepspeed_two_processes_resume_a_signed_state_and_refuse_a_crafted_one(workspace, tmp_path):
    """DeepSpeed unpickles its checkpoint without restrictions on every rank: a crafted model-states
    file is refused on both ranks before DeepSpeed opens it, while a signed state resumes.

    In bf16, as a GPU runs it: DeepSpeed casts the whole module and keeps fp32 master weights in its
    optimizer; the draft is saved from those (fp32, equal to DeepSpeed's own reconstruction from the
    saved optimizer state) with the target's exact frozen weights, and the resume continues from them."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run = new_run(workspace, "zero2")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({
        "target": {"path": str(workspace["target"])}, "run": {"output_dir": str(workspace["root"]), "name": "zero2"},
        "dump": {"draft_vocab_size": 128},
        "train": {"token_budget": 400, "ttt_steps": 3, "save_every": 0, "eval_every": 0, "eval_batches": 2,
                  "warmup_steps": 1, "mixed_precision": "bf16"}}))  # JSON is YAML
    for steps in (2, 3):  # the second launch resumes the signed state of the first (both ranks agree)
        done = _launch_zero2(recipe, f"train.max_steps={steps}")
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr and "mixed precision bf16" in done.stdout + done.stderr
    checkpoint = run / "checkpoints" / "step_00000003"
    assert trust.refusal(checkpoint) is None

    saved = load_file(str(checkpoint / "model.safetensors"))
    masters = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / "state"), tag="pytorch_model")
    floating = {name: t for name, t in saved.items() if t.is_floating_point()}
    assert floating and {t.dtype for t in floating.values()} == {torch.float32}
    config = json.loads((checkpoint / "config.json").read_text())
    frozen = {"embed_tokens.weight"} | (set() if config["train_lm_head"] else {"lm_head.weight"})
    assert "fc.weight" in floating
    for name in set(floating) - frozen:  # the optimizer's fp32 weights, not the module's bf16 rounding of them
        assert torch.equal(floating[name], masters[f"head.{name}"]), name
    assert not torch.equal(floating["fc.weight"], floating["fc.weight"].bfloat16().float())
    target = load_file(str(next(Path(workspace["target"]).glob("*.safetensors"))))
    assert torch.equal(floating["embed_tokens.weight"], target["model.embed_tokens.weight"].float())  # frozen, exact

    marker = tmp_path / "code-ran"
    crafted = checkpoint / "state" / "pytorch_model" / "mp_rank_00_model_states.pt"
    assert crafted.is_file()
    torch.save({"payload": _TouchOnLoad(str(marker))}, crafted)
    refused = _launch_zero2(recipe, "train.max_steps=4")
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0
    # every rank stops with the verdict of the main process; counted in the whole output, since the two ranks
    # share one stream and one's line can begin before the other's newline is written
    assert output.count("eyas: error: refusing to resume") == 2, output[-3000:]
    assert "state/pytorch_model/mp_rank_00_model_states.pt (size changed)" in output
    assert not marker.exists()
    TorchCheckpointEngine().load(str(crafted))  # the control: DeepSpeed's loader runs it
    assert marker.exists()
