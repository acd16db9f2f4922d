"""vLLM from eyas: the offline engine (target alone, target + an exported draft) and its OpenAI server.

    from eyas.eval.engine_vllm import offline_runs, VllmRun, VllmServer
    results = offline_runs(target_dir, prompts_ids, max_new_tokens=32, dtype="float32",
                           runs=[VllmRun("target"), draft_run("eagle3 chain:3", export_dir, "eagle3", k=3)])

Every engine run happens in a child process (`python -m eyas.eval.engine_vllm offline JOB RESULT`)
whose output goes to a log file: vLLM's own logging, its weight loading and its engine core
(run in that process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) are all in one place, a hung engine
can be stopped by its PID, and eyas's process never imports vllm. Only this module imports it,
and only in the child: a missing vLLM is one `EyasError` line with the install command.

What one run reports: the output token ids per prompt, wall time of the batched `generate`
(all prompts at once, as a server runs them) and tokens/s, and with a draft vLLM's own
counters from `LLM.get_metrics()`: `vllm:spec_decode_num_drafts` (verifies that carried a
draft), `vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and
`vllm:spec_decode_num_accepted_tokens_per_pos` (accepted at position d, counted when 1..d
were accepted: eyas's cumulative acceptance times the verifies, not α).

Loading is checked, not assumed: the child wraps vLLM's `AutoWeightsLoader.load_weights` and
records, for the draft model, every parameter it did not load. The only ones allowed are
those the engine takes from the target afterwards (`VllmRun.shared`: what the kind's export
leaves out, `eyas.train.export.taken_from_target`); anything else, an unexpected tensor (vLLM
raises), or a warning vLLM logs while loading the draft's weights, is an `EyasError` naming
the tensor. vLLM's EAGLE-1 class does not report
missing weights itself (its `load_weights` returns nothing), which is why this check exists.

`VLLM_CPU_KVCACHE_SPACE` (GiB) bounds vLLM's KV cache on a CPU; the default here is 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.decode import stop_token_ids
from eyas.draft.checkpoint import read_draft_config
from eyas.draft.registry import head_class
from eyas.errors import EyasError
from eyas.targets import resolve_target_path
from eyas.train.export import VLLM_VERIFIED, export_draft, format_spec, taken_from_target
from eyas.vllm_install import INSTALL, VLLM_CPU_VERSION, require_vllm, vllm_python  # noqa: F401  (eval's names too)
from eyas.vllm_server import VllmServer, _log_tail, child_env, free_port, stop_process  # noqa: F401  (eval's names too)

# vLLM log lines that mean a tensor was skipped, dropped or left as initialised.
LOAD_WARNING = re.compile(r"(WARNING|ERROR).*(weight|tensor|checkpoint|not initiali[sz]ed|skipp|missing|unexpected)",
                          re.IGNORECASE)


def check_vllm_version(version: str, verified: str = VLLM_VERIFIED) -> None:
    """Refuse a vLLM release other than the one eyas's export formats were served and matched with.

    Export layouts follow vLLM's model classes, which change between releases (a renamed tensor
    loads as a random layer); EYAS_VLLM_ANY_VERSION=1 runs anyway, for someone checking a new one.
    """
    if os.environ.get("EYAS_VLLM_ANY_VERSION") == "1":
        return
    if version.split(".")[:2] != verified.split(".")[:2]:
        raise EyasError(f"vLLM {version} is installed, but eyas's vLLM exports were served and matched with vLLM "
                        f"{verified} (tests/test_vllm_parity.py): install it with: {INSTALL}; or set "
                        "EYAS_VLLM_ANY_VERSION=1 to run this one and check the figures yourself")


@dataclass
class VllmRun:
    """One engine configuration: the target alone (draft None), or target + an exported draft."""
    name: str
    draft: str | None = None
    method: str = ""
    k: int = 0
    extra: dict = field(default_factory=dict)  # more --speculative-config fields (the kind's FormatSpec.speculative_extra)
    # the draft's tensors the engine takes from the target after loading: the draft model may leave them unloaded
    shared: tuple[str, ...] = ()
    engine_model: str = ""  # vLLM's draft model class, whose load record is checked (FormatSpec.engine_model)


def served_without_plugin(kind: str) -> bool:
    """Whether a plain vLLM engine serves `kind`'s export (mtp needs eyas's plugin, docs/serving-mtp.md; a format
    no engine served in eyas's tests, dspark's, is not chosen for it: `FormatSpec.engine_unchecked`)."""
    spec = head_class(kind).export.formats.get("vllm")
    return spec is not None and not spec.plugin and not spec.engine_unchecked


def unserved_reason(kind: str) -> str:
    """Why a plain vLLM engine does not serve `kind` here (for a kind `served_without_plugin` says no to)."""
    spec = head_class(kind).export.formats.get("vllm")
    if spec is not None and spec.engine_unchecked:
        return f"vLLM does not serve a {kind} head on this machine: {spec.engine_unchecked}"
    return f"vLLM serves no {kind} head without a plugin"


def _fixed_chains(shapes: list) -> list:
    """The shapes vLLM drafts as eyas does: chains of a fixed K (a confidence-cut chain is eyas's decoder's alone)."""
    return [s for s in shapes if s.kind == "chain" and not s.confidence]


def resolve_engine(setting: str, specs: list[str], shapes: list, temperature: float) -> tuple[str, str]:
    """`eval.engine` as the eval will run it: (builtin or vllm, why auto chose it; "" when not auto).

    auto takes vLLM beside eyas's decoder when everything `engine_eval` needs is there: a greedy
    eval, a chain shape, every checkpoint draft of a kind a plain vLLM engine serves, and the vLLM
    release eyas's exports were matched with installed; otherwise eyas's decoder alone, and the
    reason is the line the report and the quickstart print."""
    if setting != "auto":
        return setting, ""
    checkpoints = [s for s in specs if Path(s).is_dir()]
    unserved = sorted({kind for kind in (read_draft_config(s)["kind"] for s in checkpoints)
                       if not served_without_plugin(kind)})
    why_not = ("eval.temperature is not 0 (the engines are compared greedy)" if temperature != 0
               else "no chain:K shape in eval.shapes (vLLM drafts one chain)" if not _fixed_chains(shapes)
               else "no draft checkpoint to serve" if not checkpoints
               else unserved_reason(unserved[0]) if unserved else "")
    if not why_not:
        try:
            version = require_vllm()
            check_vllm_version(version)
            return "vllm", f"vLLM {version} is installed: its figures for the same drafts beside eyas's"
        except EyasError as exc:
            why_not = str(exc)
    return "builtin", f"eyas's decoder alone: {why_not}"


def draft_run(name: str, export: str | Path, kind: str, k: int) -> VllmRun:
    """The target + `kind`'s vLLM export drafting `k` tokens, configured as the kind's format says."""
    served = format_spec(kind, "vllm")
    return VllmRun(name, draft=str(export), method=served.method, k=k, extra=dict(served.speculative_extra),
                   shared=tuple(sorted(taken_from_target(kind, "vllm"))), engine_model=served.engine_model)


@dataclass
class VllmResult:
    name: str
    outputs: list[list[int]]
    seconds: float
    tokens: int
    tokens_per_s: float
    startup_seconds: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    load_warnings: list[str] = field(default_factory=list)

    @property
    def cumulative(self) -> list[float]:
        """P(at least d draft tokens accepted in a verify), d = 1..K (vLLM's per-position rate)."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per verify counting the bonus token (1 + accepted / drafts)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("outputs")
        out.update(cumulative=self.cumulative, tau=self.tau)
        return out


def offline_runs(target: str | Path, prompts: list[list[int]], max_new_tokens: int, runs: list[VllmRun],
                 dtype: str = "float32", max_model_len: int = 2048, seed: int = 0, kv_cache_gib: float = 1,
                 timeout: float = 1200, log: str | Path | None = None, threads: int | None = None
                 ) -> list[VllmResult]:
    """Run each configuration over the same prompts (token ids, batched) in one vLLM child process.

    Raises EyasError when vLLM is missing, does not finish in `timeout` seconds (the log's last
    lines in the message), refuses a draft, or loads one with missing/unexpected weights.
    """
    python = vllm_python()
    require_vllm(python)
    work = Path(tempfile.mkdtemp(prefix="eyas-vllm-"))
    log = Path(log) if log else work / "vllm.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    job = {"target": str(target), "prompts": prompts, "max_new_tokens": max_new_tokens, "dtype": dtype,
           "max_model_len": max_model_len, "seed": seed, "runs": [asdict(r) for r in runs]}
    (work / "job.json").write_text(json.dumps(job))
    with open(log, "w") as out:
        proc = subprocess.Popen([python, "-m", "eyas.eval.engine_vllm", "offline", str(work / "job.json"),
                                 str(work / "result.json")], stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(kv_cache_gib, threads), start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process(proc)
            raise EyasError(f"vLLM did not finish {len(runs)} run(s) in {timeout:.0f} s and was stopped; "
                            f"last lines of {log}:\n{_log_tail(log)}") from None
    result_path = work / "result.json"
    if not result_path.is_file():
        raise EyasError(f"vLLM exited with status {proc.returncode} before writing its results; "
                        f"last lines of {log}:\n{_log_tail(log)}")
    raw = json.loads(result_path.read_text())
    if raw.get("error"):
        raise EyasError(f"vLLM failed in run '{raw.get('run')}': {raw['error']} (log: {log})")
    results = [VllmResult(**r) for r in raw["results"]]
    attach_log_warnings(results, log)
    for run, result in zip(runs, results):
        check_load(run, result, log)
    return results


def check_load(run: VllmRun, result: VllmResult, log: Path) -> None:
    if not run.draft:
        return
    if result.unloaded:
        raise EyasError(f"vLLM loaded the {run.method} draft '{run.draft}' but left {len(result.unloaded)} tensor(s) "
                        f"uninitialised, first '{result.unloaded[0]}'; the export does not match the draft model "
                        f"of vLLM {VLLM_CPU_VERSION} (log: {log})")
    if result.load_warnings:
        raise EyasError(f"vLLM warned while loading the draft '{run.draft}': {result.load_warnings[0].strip()} "
                        f"(log: {log})")


# ----------------------------------------------------------------------------- eyas vs vLLM


def parity_tolerance(rounds_eyas: int, rounds_vllm: int, eyas: list[float], vllm: list[float]) -> list[float]:
    """Allowed |cumulative_eyas[d] - cumulative_vllm[d]| per depth d (both at temperature 0).

    Same prompts, same greedy path (checked separately: every output equals the target's greedy
    output), so a draft token is accepted in both engines exactly when the draft's argmax is the
    target's next greedy token. The engines can only disagree where an argmax flips between
    their kernels (fused qkv, other summation orders, bf16 roundings in other places): at a
    top-2 logit margin below their numeric difference. Each flip changes one verify's accepted
    count and moves where the following verifies start, and from there the two engines draft
    from different positions of the same greedy text. The worst case is that every verify is
    re-cut this way, so the two per-position rates become two independent estimates of the same
    rate p over n_e and n_v verifies: their difference has standard deviation
    sqrt(p(1-p) (1/n_e + 1/n_v)). The bound is three of those at the pooled rate, plus one
    verify's worth (1/min(n)), for the count itself being an integer. With no flips the gap is
    0 (fp32 is expected there); the bound holds the bf16 runs, whose flips are common, and a
    real disagreement (a wrong weight, an offset position, a lost bias) moves the rates by far
    more: a random draft accepts nothing.
    """
    n_e, n_v = max(rounds_eyas, 1), max(rounds_vllm, 1)
    out = []
    for a, b in zip(eyas, vllm):
        pooled = (a * n_e + b * n_v) / (n_e + n_v)
        sigma = (pooled * (1 - pooled) * (1 / n_e + 1 / n_v)) ** 0.5
        out.append(3 * sigma + 1 / min(n_e, n_v))
    return out


def strip_eos(ids: list[int], eos: Any) -> list[int]:
    ids, stop = list(ids), set(eos)
    while ids and ids[-1] in stop:
        ids.pop()
    return ids


def parity_report(builtin: dict, served: list[VllmResult], labels: dict[str, str], eos: Any) -> dict:
    """Both decoders' figures per configuration: builtin = `eval.runner.evaluate`'s result,
    served[0] = vLLM's target alone, labels = vLLM run name -> eyas config label."""
    configs = {c["label"]: c["overall"] for c in builtin["configs"]}
    target = served[0]
    base = builtin.get("baseline") or {}
    report = {"vllm_target": {"tokens_per_s": target.tokens_per_s, "seconds": target.seconds, "tokens": target.tokens},
              "eyas_target": base.get("overall"), "rows": {}}
    for result in served[1:]:
        ours = configs[labels[result.name]]
        k = len(result.accepted_per_pos)
        rounds = ours["rounds"]
        accepts = (list(ours["accepts"]) + [0] * k)[:k]
        eyas = {"rounds": rounds, "accepted_per_pos": accepts,
                "cumulative": [a / rounds if rounds else 0.0 for a in accepts], "tau": ours["tau"],
                "tokens_per_s": ours["tokens_per_s"], "speedup": ours.get("speedup"),
                **(ours.get("greedy_match") or {"matched": 0, "compared": 0})}
        vllm = result.summary()
        vllm["speedup"] = result.tokens_per_s / target.tokens_per_s if target.tokens_per_s else None
        tolerance = parity_tolerance(rounds, result.drafts, eyas["cumulative"], vllm["cumulative"])
        report["rows"][result.name] = {
            "eyas_label": labels[result.name], "eyas": eyas, "vllm": vllm,
            "gap": [b - a for a, b in zip(eyas["cumulative"], vllm["cumulative"])], "tolerance": tolerance,
            "within_tolerance": all(abs(b - a) <= t for a, b, t in zip(eyas["cumulative"], vllm["cumulative"],
                                                                        tolerance)),
            "vllm_equals_vllm_target": sum(strip_eos(a, eos) == strip_eos(b, eos)
                                           for a, b in zip(result.outputs, target.outputs)),
        }
    return report


def format_parity(report: dict) -> str:
    """The side-by-side table: per configuration, both decoders' verifies, accepted per position,
    cumulative acceptance, tau and tokens/s, and the gap with its tolerance."""
    lines = [f"eyas vs vLLM, {report.get('dtype', '')}, {report.get('prompts', '?')} prompts x "
             f"{report.get('max_new_tokens', '?')} tokens, T=0 (cumulative_d = accepted at position d / verifies)"]
    lines.append(f"{'config':<18} {'engine':<6} {'verifies':>8} {'accepted per pos':<18} {'cumulative':<22} "
                 f"{'tau':>6} {'tok/s':>7}")
    for name, row in report["rows"].items():
        for engine, fig in (("eyas", row["eyas"]), ("vLLM", row["vllm"])):
            rounds = fig["rounds"] if engine == "eyas" else fig["drafts"]
            cum = " ".join(f"{c:.4f}" for c in fig["cumulative"])
            per = " ".join(str(a) for a in fig["accepted_per_pos"])
            lines.append(f"{name:<18} {engine:<6} {rounds:>8} {per:<18} {cum:<22} {fig['tau'] or 0:>6.3f} "
                         f"{fig['tokens_per_s'] or 0:>7.2f}")
        gaps = " ".join(f"{g:+.4f}" for g in row["gap"])
        tols = " ".join(f"{t:.4f}" for t in row["tolerance"])
        lines.append(f"{'':<18} gap (vLLM - eyas) {gaps}; tolerance {tols}; "
                     f"{'within' if row['within_tolerance'] else 'OUTSIDE'}")
    vt, et = report.get("vllm_target") or {}, report.get("eyas_target") or {}
    lines.append(f"target alone: vLLM {vt.get('tokens_per_s', 0):.2f} tok/s (batched), "
                 f"eyas {et.get('tokens_per_s') or 0:.2f} tok/s (batched as eval.batch_size says)")
    if "eyas_target_equals_vllm_target" in report:
        lines.append(f"target outputs equal across engines: {report['eyas_target_equals_vllm_target']} of "
                     f"{report.get('prompts')}")
    return "\n".join(lines)


def speedup_lines(report: dict) -> list[str]:
    """One line per served configuration of an `engine_eval` report: vLLM's tau and speedup over its
    own target alone, beside eyas's decoder's for the same draft and shape (each engine against its
    own target-alone run on the same prompts, so the two speedups are comparable, the tok/s are not)."""
    def speedup(value: Any) -> str:
        return f"{value:.2f}x" if value else "n/a"

    lines = []
    for row in report.get("rows", {}).values():
        ours, served = row["eyas"], row["vllm"]
        lines.append(f"{row['eyas_label']}: vLLM {report.get('vllm_version', '')} tau {served['tau'] or 0:.2f}, "
                     f"speedup {speedup(served.get('speedup'))} over its target alone; eyas's decoder tau "
                     f"{ours['tau'] or 0:.2f}, speedup {speedup(ours.get('speedup'))}")
    return lines


def engine_eval(specs: list[str], shapes: list, encoded: list, builtin: dict, target: Any, tokenizer: Any,
                target_path: str, max_new_tokens: int, out_dir: Path, seed: int = 0) -> dict:
    """`eval.engine=vllm`: export every checkpoint draft to vLLM's format, run vLLM over the same
    prompts (target alone, then target + draft for each chain:K shape) and return the parity
    report (both decoders' figures; `format_parity` prints it)."""
    version = require_vllm()
    check_vllm_version(version)
    chains = _fixed_chains(shapes)
    if not chains:
        raise EyasError("eval.engine=vllm runs chain:K shapes only (vLLM's EAGLE proposer drafts one chain, and its "
                        "confidence-driven length is CUDA-only); add one to eval.shapes, e.g. chain:3")
    dtype = str(target.dtype).replace("torch.", "")
    target_dir = resolve_target_path(target_path)
    runs, labels, exported = [VllmRun("target")], {}, {}
    configs = builtin["configs"]
    for i, spec in enumerate(specs):
        if not Path(spec).is_dir():
            continue  # truncated:N / mixture:LAM exist only in eyas's decoder

        kind = read_draft_config(spec)["kind"]
        if not served_without_plugin(kind):
            raise EyasError(f"draft '{spec}': {unserved_reason(kind)}; use eval.engine=builtin")
        folder = export_draft(spec, "vllm", out_dir / "vllm" / f"draft-{i}", dtype=dtype,
                              speculative_tokens=max(s.depth for s in chains), target_path=str(target_dir))
        exported[spec] = str(folder)
        for shape in chains:
            name = f"{Path(spec).name or spec}#{i} {shape.spec}"
            label = next(c["label"] for c in configs[i * len(shapes):(i + 1) * len(shapes)] if c["shape"] == shape.spec)
            runs.append(draft_run(name, folder, kind, shape.depth))
            labels[name] = label
    if len(runs) == 1:
        raise EyasError("eval.engine=vllm needs a draft checkpoint (truncated:N and mixture:LAM have no vLLM form)")
    max_len = max(len(e.ids) for e in encoded) + max_new_tokens + 16
    served = offline_runs(target_dir, [e.ids for e in encoded], max_new_tokens, runs, dtype=dtype,
                          max_model_len=max(max_len, 256), seed=seed, log=out_dir / "vllm.log")
    report = parity_report(builtin, served, labels, stop_token_ids(target, tokenizer))
    report.update(vllm_version=version, dtype=dtype, prompts=len(encoded), max_new_tokens=max_new_tokens,
                  exports=exported, log=str(out_dir / "vllm.log"))
    return report


# ----------------------------------------------------------------------------- the child


def record_loads(records: list[dict]) -> None:
    """Wrap AutoWeightsLoader.load_weights: record what each model loaded and what it did not."""
    from vllm.model_executor.models import utils

    original = utils.AutoWeightsLoader.load_weights
    if getattr(original, "_eyas", False):
        return

    def load_weights(self, weights, *args, **kwargs):
        loaded = original(self, weights, *args, **kwargs)
        names = {n for n, _ in self.module.named_parameters()}
        records.append({"module": type(self.module).__name__, "loaded": sorted(loaded or []),
                        "unloaded": sorted(names - set(loaded or []))})
        return loaded

    load_weights._eyas = True
    utils.AutoWeightsLoader.load_weights = load_weights


def draft_unloaded(records: list[dict], run: dict) -> list[str]:
    """The draft's parameters vLLM left unloaded in `run` (an `asdict(VllmRun)`), from the load record of its draft
    model class: that outermost loader finishes last and reports, under full names, what its submodules' loaders
    loaded (a submodule may be called once per run of its names, as DFlash's is). A draft whose class left no
    record is refused: the check would otherwise pass without looking."""
    if not run["draft"] or not run["engine_model"]:
        return []
    drafted = [r for r in records if r["module"] == run["engine_model"]][-1:]
    if not drafted:
        raise RuntimeError(f"vLLM loaded the draft of '{run['name']}' without a load record of {run['engine_model']} "
                           f"(records: {sorted({r['module'] for r in records})}); the kind's FormatSpec.engine_model "
                           "names another class than this vLLM builds")
    return unexpected_unloaded(drafted, run["shared"])


def unexpected_unloaded(records: list[dict], shared: list[str] | tuple[str, ...]) -> list[str]:
    """The parameters `records` left unloaded that are not among `shared` (taken from the target), by full name."""
    return sorted({n for r in records for n in r["unloaded"] if not any(n == s or n.endswith("." + s) for s in shared)})


def spec_decode_counters(llm: Any) -> dict:
    found: dict = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for metric in llm.get_metrics():
        if metric.name in names:
            found[names[metric.name]] = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["accepted_per_pos"] = [int(v) for v in metric.values]
    return found


def _child_offline(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    out: dict = {"results": []}
    current = ""
    try:
        import gc

        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        records: list[dict] = []
        record_loads(records)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
        params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], seed=job["seed"])
        for run in job["runs"]:
            current = run["name"]
            print(f"EYAS_RUN_BEGIN {current}", flush=True)
            records.clear()
            spec = None
            if run["draft"]:
                spec = {"method": run["method"], "model": run["draft"], "num_speculative_tokens": run["k"], **run["extra"]}
            started = time.perf_counter()
            llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=job["seed"],
                      enforce_eager=True, disable_log_stats=False, speculative_config=spec,
                      max_num_seqs=max(1, len(prompts)))
            startup = time.perf_counter() - started
            print("EYAS_LOADED", flush=True)
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
            before = spec_decode_counters(llm) if spec else None
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            metrics = spec_decode_counters(llm) if spec else {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
            if before:  # the counters are cumulative: take away the warm-up's
                for key in ("drafts", "draft_tokens", "accepted"):
                    metrics[key] -= before[key]
                metrics["accepted_per_pos"] = [a - b for a, b in zip(metrics["accepted_per_pos"],
                                                                      before["accepted_per_pos"] or
                                                                      [0] * len(metrics["accepted_per_pos"]))]
            ids = [list(o.outputs[0].token_ids) for o in outputs]
            tokens = sum(len(x) for x in ids)
            unloaded = draft_unloaded(records, run)
            print("EYAS_RUN_END", flush=True)
            out["results"].append({"name": current, "outputs": ids, "seconds": seconds, "tokens": tokens,
                                   "tokens_per_s": tokens / seconds if seconds else 0.0, "startup_seconds": startup,
                                   "unloaded": unloaded, "load_warnings": [], **metrics})
            del llm
            gc.collect()
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        out.update(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:2000], run=current)
    Path(result_path).write_text(json.dumps(out))
    return 0


def attach_log_warnings(results: list[VllmResult], log: Path) -> None:
    """Warnings vLLM logged between a run's start and the end of its loading, per run."""
    current, loading = None, False
    by_name = {r.name: r for r in results}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("EYAS_RUN_BEGIN "):
            current, loading = by_name.get(line[len("EYAS_RUN_BEGIN "):]), True
        elif line.startswith("EYAS_LOADED"):
            loading = False
        elif loading and current is not None and LOAD_WARNING.search(line) and "draft" in line.lower():
            current.load_warnings.append(line)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "offline":
        return _child_offline(argv[1], argv[2])
    print("usage: python -m eyas.eval.engine_vllm offline JOB.json RESULT.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
