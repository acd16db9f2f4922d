"""`eyas plan`: the 8B recipe's table from its config.json alone, the one-line errors, the fit check that
training calls, the step count and shard bytes against a real run, and the activation formula against
what autograd keeps. The prediction against measured peak memory is benchmarks/bench_plan.py's job."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import make_workspace, new_run

from eyas import memory as shared
from eyas.cli import plan
from eyas.config import load_recipe
from eyas.data import memory as dump_memory
from eyas.errors import EyasError
from eyas.train import memory as train_memory
from eyas.train.losses import Teacher
from eyas.train.ttt import unroll

REPO = Path(__file__).resolve().parents[1]
RECIPE_8B = REPO / "recipes" / "llama3.1-8b-eagle3.yaml"


def _bench():
    """benchmarks/bench_plan.py, for its copy of Llama-3.1-8B's config.json."""
    sys.path.insert(0, str(REPO / "benchmarks"))  # its `from machine import ...`
    try:
        spec = importlib.util.spec_from_file_location("bench_plan", REPO / "benchmarks" / "bench_plan.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


LLAMA31_8B = _bench().LLAMA31_8B_CONFIG


@pytest.fixture()
def config_8b(tmp_path) -> Path:
    """A folder holding Llama-3.1-8B-Instruct's config.json and nothing else (no weights, no tokenizer)."""
    folder = tmp_path / "llama-3.1-8b-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA31_8B))
    return folder


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_8b_recipe_plans_from_its_config_alone(config_8b, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe's models/Llama-3.1-8B-Instruct is not here
    code, out, err = _run(capsys, RECIPE_8B, "--gpu", "h100-80gb", "--gpus", "8", "--target-config", config_8b)
    assert code == 0, err
    assert "8 x h100-80gb (79.6 GiB each)" in out
    assert "8.03B parameters (hidden 4096, 32 layers, vocabulary 128256)" in out
    assert "424.7M trainable + 525.3M frozen parameters, draft vocabulary 32000" in out
    # four fp8 features of 4096 values + a bf16 scale each, 4-byte ids (vocabulary > 65536), the loss mask
    assert "shards: 16,397 bytes per token" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in ("dump", "train", "eval")}
    assert set(rows) == {"dump", "train", "eval"}
    assert all("fits" in row and "DOES NOT FIT" not in row for row in rows.values()), out
    assert "weights 15.0" in rows["dump"]  # 8.03B parameters in bf16
    assert "steps: unknown" in out and "does not fit" not in out


def test_the_8b_draft_matches_the_hand_count(config_8b):
    """EAGLE-3 on Llama-3.1-8B: fc 3H·H, q/k/v read 2H, o, the gated MLP, the 32000-row lm_head, four norms."""
    recipe = load_recipe(str(RECIPE_8B))
    config = plan.read_config(recipe, str(config_8b))
    h, q, kv, inter, draft_vocab = 4096, 32 * 128, 8 * 128, 14336, 32000
    trainable = 3 * h * h + 2 * h * q + 2 * (2 * h * kv) + q * h + 3 * h * inter + draft_vocab * h + 4 * h
    size = train_memory.draft_size(recipe, config)
    assert abs(size.trainable / trainable - 1) < 0.01
    assert size.frozen == 128256 * h  # the target's embedding, frozen in the head
    assert shared.shapes_of(config).params == 8_030_261_248  # Llama-3.1-8B's published parameter count


def test_a_target_class_that_cannot_be_built_is_counted_as_its_layout(config_8b, monkeypatch):
    """A target whose class needs its folder's code: the Llama-like count gives the same 8.03B."""
    from transformers import AutoModelForCausalLM

    def needs_code(*args, **kwargs):
        raise ValueError("this model needs trust_remote_code")

    config = plan.read_config(load_recipe(str(RECIPE_8B)), str(config_8b))
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", needs_code)
    assert shared.shapes_of(config).params == 8_030_261_248


def test_the_readme_plans_the_training_it_runs(config_8b, capsys, tmp_path, monkeypatch):
    """The README's GPU quickstart plans with the accelerate config and GPU count its train command launches
    with, and the plan says it planned that sharding (ZeRO-2), not DDP."""
    readme = (REPO / "README.md").read_text()
    recipe = re.search(r"^R=(\S+)", readme, flags=re.MULTILINE).group(1)
    plan_line = re.search(r"^eyas plan \$R (.+)$", readme, flags=re.MULTILINE).group(1).split()
    train_line = re.search(r"^accelerate launch (.+) -m eyas.train \$R$", readme, flags=re.MULTILINE).group(1).split()
    option = dict(zip(plan_line[::2], plan_line[1::2]))
    launch = dict(zip(train_line[::2], train_line[1::2]))
    assert option["--accelerate-config"] == launch["--config_file"] and option["--gpus"] == launch["--num_processes"]
    monkeypatch.chdir(REPO)
    code, out, err = _run(capsys, recipe, *plan_line, "--target-config", config_8b)
    assert code == 0, err
    assert "training planned with DeepSpeed ZeRO-2" in out
    code, out, _ = _run(capsys, recipe, "--gpu", option["--gpu"], "--gpus", option["--gpus"], "--target-config", config_8b)
    assert "training planned with DDP" in out  # without the config: what the plan assumes, said


def test_a_config_json_file_is_enough(config_8b, capsys):
    code, out, err = _run(capsys, RECIPE_8B, "--target-config", config_8b / "config.json", "--tokens", "600000000",
                          "--gpus", "8")
    assert code == 0, err
    # at least epochs x tokens / (GPUs x grad_accum x token_budget): 10 x 600M / (8 x 1 x 8192)
    assert f"steps: {math.ceil(10 * 600_000_000 / (8 * 8192)):,} optimizer steps" in out
    assert f"{600_000_000 * 16397 / 2**30:,.1f} GiB on disk" in out


def test_unknown_gpu_is_one_line_naming_the_known_ones(config_8b, capsys):
    code, out, err = _run(capsys, RECIPE_8B, "--gpu", "h100", "--target-config", config_8b)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "unknown GPU 'h100'" in err and all(name in err for name in plan.GPUS)


def test_a_target_without_config_is_one_line_with_the_fix(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, RECIPE_8B, "--gpu", "h100-80gb")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "models/Llama-3.1-8B-Instruct" in err and "--target-config" in err and "config.json" in err


def test_an_unreadable_config_is_one_line(capsys, tmp_path):
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    code, out, err = _run(capsys, RECIPE_8B, "--target-config", broken)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(broken) in err


def test_what_does_not_fit_is_named_with_what_would(config_8b, capsys):
    code, out, err = _run(capsys, RECIPE_8B, "train.token_budget=65536", "--gpu", "h100-80gb", "--gpus", "8",
                          "--target-config", config_8b)
    assert code == 0, err
    problem = out.split("does not fit:\n", 1)[1].strip()
    assert problem.startswith("train.token_budget=65536 needs ") and "> 79.6 GiB (h100-80gb)" in problem
    fits = int(problem.split("; train.token_budget=", 1)[1].split(" ")[0])
    assert 2048 <= fits < 65536
    recipe = load_recipe(str(RECIPE_8B), [f"train.token_budget={fits}"])
    config = plan.read_config(recipe, str(config_8b))
    need = train_memory.train_need(recipe, config, shared.shapes_of(config), train_memory.draft_size(recipe, config),
                                   shared.Hardware("cuda", plan.GPUS["h100-80gb"] * shared.MIB, 8))
    assert need.device_total <= plan.GPUS["h100-80gb"] * shared.MIB


def test_refuse_if_too_big_names_the_setting_and_passes_what_fits(config_8b):
    config = plan.read_config(load_recipe(str(RECIPE_8B)), str(config_8b))
    memory = plan.GPUS["h100-80gb"] * shared.MIB
    train_memory.refuse_if_too_big("train", load_recipe(str(RECIPE_8B)), config, memory, 8)  # the shipped recipe fits
    with pytest.raises(EyasError) as refused:
        train_memory.refuse_if_too_big("train", load_recipe(str(RECIPE_8B), ["train.token_budget=131072"]), config, memory, 8)
    message = str(refused.value)
    assert "train.token_budget=131072 needs" in message and "fits" in message
    # ZeRO-3 over 8 GPUs holds less per GPU than DDP: the same recipe needs less there
    recipe = load_recipe(str(RECIPE_8B))
    hw = shared.Hardware("cuda", memory, 8)
    sizes = shared.shapes_of(config), train_memory.draft_size(recipe, config)
    ddp = train_memory.train_need(recipe, config, *sizes, hw, "ddp").device_total
    assert train_memory.train_need(recipe, config, *sizes, hw, "zero3").device_total < ddp


def test_an_8k_run_whose_attention_falls_back_to_dense_is_refused_at_start(config_8b):
    """An 8K-token run of the 8B recipe fits one H100 with the fused TTT attention (38 GiB); where flash cannot
    run its shapes the dense path needs 100 GiB: refused with the reason, the figure and what fits."""
    recipe = load_recipe(str(RECIPE_8B), ["data.max_length=8192", "train.token_budget=8192"])
    config = plan.read_config(recipe, str(config_8b))
    memory = plan.GPUS["h100-80gb"] * shared.MIB
    train_memory.refuse_if_too_big("train", recipe, config, memory, 8)  # fused: fits
    with pytest.raises(EyasError) as refused:
        train_memory.refuse_if_too_big("train", recipe, config, memory, 8, dense_reason="flash cannot run these shapes")
    message = str(refused.value)
    assert "needs 100.0 GiB > 79.6 GiB" in message and "runs densely here (flash cannot run these shapes)" in message
    assert "data.max_length=4096 fits" in message and "train.checkpoint_unroll=true fits" in message
    # fp32 on a GPU runs densely by itself: bf16 is what fits
    with pytest.raises(EyasError, match=r"train\.mixed_precision=bf16 fits \(38\.0 GiB"):
        train_memory.refuse_if_too_big("train", shared.with_setting(recipe, "train.mixed_precision", "fp32"), config, memory, 8)


def test_accelerate_configs_are_read_for_their_sharding():
    folder = REPO / "recipes" / "accelerate"
    assert plan.accelerate_sharding(str(folder / "ddp.yaml")) == "ddp"
    assert plan.accelerate_sharding(str(folder / "deepspeed_zero2.yaml")) == "zero2"
    assert plan.accelerate_sharding(str(folder / "deepspeed_zero3.yaml")) == "zero3"
    assert plan.accelerate_sharding(str(folder / "fsdp.yaml")) == "fsdp"


def test_a_running_accelerator_tells_its_sharding():
    """What training passes to the fit check, from accelerate's state (DistributedType and the ZeRO stage)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    def accelerator(kind, stage=None):
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)))

    assert train_memory.sharding_of(accelerator(DistributedType.MULTI_GPU)) == "ddp"
    assert train_memory.sharding_of(accelerator(DistributedType.NO)) == "ddp"
    assert train_memory.sharding_of(accelerator(DistributedType.DEEPSPEED, 2)) == "zero2"
    assert train_memory.sharding_of(accelerator(DistributedType.DEEPSPEED, 3)) == "zero3"
    assert train_memory.sharding_of(accelerator(DistributedType.FSDP)) == "fsdp"


# ----------------------------------------------------------------------------- against a real tiny run


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_llama_dir):
    return make_workspace(tmp_path_factory.mktemp("plan"), tiny_llama_dir, 48)


def _tiny_recipe(ws, name: str, *extra: str):
    new_run(ws, name)
    return load_recipe(None, [f"target.path={ws['target']}", f"run.output_dir={ws['root']}", f"run.name={name}",
                              "dump.draft_vocab_size=128", "dump.encoding=bf16", "data.max_length=96",
                              "train.token_budget=400", "train.ttt_steps=2", "train.loader_workers=0", *extra])


def test_steps_and_shard_bytes_match_the_trainer_and_the_dump(workspace, monkeypatch):
    """The step count from the prepared data is the trainer's; bytes per token are the dump's (plus its
    per-sample offsets, indices and checksums). On a CPU the trainer never calls the fit check."""
    from eyas.train import loop

    def never(*args, **kwargs):
        raise AssertionError("the fit check ran on a CPU")

    monkeypatch.setattr(loop, "refuse_if_too_big", never)
    recipe = _tiny_recipe(workspace, "steps", "train.epochs=3", "train.grad_accum=2")
    trainer = loop.Trainer(recipe)
    lengths = plan.prepared_lengths(recipe)
    steps, how = train_memory.optimizer_steps(recipe, 1, lengths["train"], None)
    assert steps == trainer.setup.total_steps and "from" in how
    manifest = json.loads((recipe.run_dir / "shards" / "manifest.json").read_text())
    per_token = sum(dump_memory.shard_bytes(recipe, plan.read_config(recipe)).values())
    assert per_token == 4 * 64 * 2 + 2 + 1  # three fused layers + last hidden in bf16, uint16 ids, the mask
    overhead = manifest["bytes_per_token"] - per_token
    assert 0 < overhead < 24 * manifest["num_samples"] / manifest["num_tokens"] + 0.2 * per_token


# ----------------------------------------------------------------------------- the activation formula


def _kept_by_autograd(kind: str, regime: str, steps: int, tokens: int = 96) -> tuple[int, float]:
    """(bytes of the tensors autograd keeps for one unroll, the plan's figure for them) on a small head."""
    from transformers import LlamaConfig

    from eyas.draft.registry import build_head

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4096, architectures=["LlamaForCausalLM"])
    recipe = load_recipe(None, [f"draft.kind={kind}", f"draft.num_steps={steps}", f"train.ttt_steps={steps}",
                                "dump.draft_vocab_size=256"])
    d2t = torch.zeros(256, dtype=torch.long)
    torch.manual_seed(0)
    head = build_head(recipe.draft, config, [2, 4, 5], d2t)
    if regime == "half":
        head = head.to(torch.bfloat16)
    batch = {"input_ids": torch.randint(0, 512, (1, tokens)), "loss_mask": torch.ones(1, tokens),
             "attention_mask": torch.ones(1, tokens, dtype=torch.long), "aux_hidden": torch.randn(1, tokens, 192),
             "last_hidden": torch.randn(1, tokens, 64)}
    known = {t.untyped_storage().data_ptr() for t in [*head.parameters(), *batch.values()]}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
            unroll(head, batch, Teacher(torch.randn(512, 64), d2t, 2048), steps, {"forward_kl": 1.0})
    precision = {"fp32": train_memory.Precision("fp32", "no", 4, 4, 4, False),
                 "autocast": train_memory.Precision("autocast", "bf16", 4, 4, 2, True),
                 "half": train_memory.Precision("half", "bf16", 2, 2, 2, False)}[regime]
    s, d = shared.shapes_of(config), train_memory.draft_size(recipe, config)
    feature_width = 192 if kind == "eagle3" else 64
    predicted = (train_memory.unroll_bytes(s, d, precision, steps, tokens, tokens, False, False)
                 + train_memory.projection_bytes(s, d, precision, tokens, feature_width)
                 + tokens * (4 * d.draft_vocab + 4)  # the teacher's probabilities and the loss weights
                 + (2 * d.trainable if precision.casts else 0))  # autocast's cached half weights
    return sum(kept.values()), predicted


@pytest.mark.parametrize("kind,regime,bound", [("eagle3", "fp32", 0.01), ("eagle3", "half", 0.01),
                                                ("eagle3", "autocast", 0.05), ("mtp", "fp32", 0.01),
                                                ("mtp", "autocast", 0.05), ("mtp", "half", 0.1)])
def test_the_unroll_formula_is_what_autograd_keeps(kind, regime, bound):
    """Three unrolled steps through the fused attention: the formula counts the kept tensors' bytes."""
    measured, predicted = _kept_by_autograd(kind, regime, steps=3)
    assert abs(measured / predicted - 1) <= bound, (measured, predicted)


# ----------------------------------------------------------------------------- mixture-of-experts targets

# The fields of the published config.json files that the plan reads (Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b;
# Qwen3-235B-A22B is the 30B's layout, wider and deeper).
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_hidden_layers": 94, "num_attention_heads": 64}
GPT_OSS_20B = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
               "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
               "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
               "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
               "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "original_max_position_embeddings": 4096},
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": True,
               "tie_word_embeddings": False}


def _config_file(tmp_path: Path, name: str, config: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config, billions, width", [(QWEN3_30B_A3B, 30.5, 8 * 768), (GPT_OSS_20B, 20.9, 4 * 2880)],
                         ids=["qwen3-30b-a3b", "gpt-oss-20b"])
def test_an_moe_target_counts_every_expert_and_runs_its_routed_width(tmp_path, config, billions, width):
    """Memory holds every expert (the published totals), a token's activations only its routed experts'."""
    recipe = load_recipe(str(REPO / "recipes" / "qwen3-30b-a3b-eagle3.yaml"))
    shapes = shared.shapes_of(plan.read_config(recipe, str(_config_file(tmp_path, "moe", config))))
    assert round(shapes.params / 1e9, 1) == billions and shapes.mlp_width == width


@pytest.mark.parametrize("name, config, parts", [
    ("qwen3-30b-a3b-eagle3", QWEN3_30B_A3B, {"dump": "40.1", "train": "21.4", "eval": "60.0"}),
    ("gpt-oss-20b-eagle3", GPT_OSS_20B, {"dump": "42.9", "train": "24.4", "eval": "42.7"})])
def test_the_moe_recipes_plan_as_their_headers_say(tmp_path, capsys, monkeypatch, name, config, parts):
    recipe = REPO / "recipes" / f"{name}.yaml"
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, recipe, "--gpu", "h100-80gb", "--gpus", "8", "--target-config",
                          _config_file(tmp_path, name, config))
    assert code == 0 and "does not fit" not in out, err + out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()[:1] in (["dump"], ["train"], ["eval"])}
    assert rows == parts
    header = recipe.read_text().replace("\n# ", " ")
    assert all(f"{stage} {gib} GiB" in header for stage, gib in parts.items()), "the recipe's header quotes the plan"


def test_a_target_too_big_for_one_gpu_is_told_the_vllm_dump_that_fits(tmp_path, capsys):
    """Qwen3-235B-A22B in bf16 (438 GiB) on 8 x H200: the transformers dump cannot hold it, a vLLM engine over 4
    GPUs can (a quarter of the weights each, under vLLM's 90% of the GPU)."""
    path = _config_file(tmp_path, "qwen3-235b", QWEN3_235B_A22B)
    recipe_path = REPO / "recipes" / "qwen3-30b-a3b-eagle3.yaml"
    code, out, err = _run(capsys, recipe_path, "dump.backend=transformers", "--gpu", "h200-141gb", "--gpus", "8",
                          "--target-config", path)
    assert code == 0, err
    dump_line = next(line for line in out.split("does not fit:\n", 1)[1].splitlines() if "dump.token_budget" in line)
    assert "dump.backend=vllm dump.vllm_tensor_parallel_size=4 fits" in dump_line
    recipe = load_recipe(str(recipe_path), ["dump.vllm_tensor_parallel_size=4"])
    config = plan.read_config(recipe, str(path))
    hw = plan.hardware("h200-141gb", 8, None)
    s = shared.shapes_of(config)
    need = dump_memory.dump_need(recipe, config, s, hw)
    assert need.device["weights"] == s.params * 2 / 4
    assert need.device["vLLM headroom"] == pytest.approx(0.1 * hw.memory)
    assert need.device_total <= hw.memory and need.host == {"running": need.host["running"]}


def test_a_streamed_8b_run_plans_its_engines_and_window(config_8b, capsys, tmp_path, monkeypatch):
    """train.source=stream: engines per trainer GPU from the FLOPs of a capture and of a trained token (or from
    measured rates), and the window's disk and host bytes."""
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, RECIPE_8B, "train.source=stream", "--gpu", "h100-80gb", "--gpus", "8",
                          "--target-config", config_8b)
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("stream:"))
    # 2 x 8.03e9 FLOPs a capture; 6 x 424.7e6 x 7 unrolled steps + 2 x 4096 x 128256 a trained token
    assert "16.1 GFLOP a captured token against 18.9 GFLOP a trained one" in line
    assert line.startswith("stream: 10 engine GPU(s) keep 8 trainer GPU(s) fed (1.18 per trainer")
    # 64 samples of 2,048 tokens (data.max_length: nothing prepared): 4 captured layers x 4096 bf16 values on disk,
    # 16,397 bytes of codes a token in host memory
    assert "window of 64 samples (mean 2,048 tokens) per trainer process: 4.00 GiB of engine files on disk, " \
           "2.00 GiB of codes in host memory" in out
    code, out, err = _run(capsys, RECIPE_8B, "train.source=stream", "--gpus", "8", "--target-config", config_8b,
                          "--engine-tokens-per-s", "40000", "--trainer-tokens-per-s", "10000")
    assert "stream: 2 engine GPU(s) keep 8 trainer GPU(s) fed (0.25 per trainer; measured" in out
