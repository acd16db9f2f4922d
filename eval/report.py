"""The eval report as a terminal table (rich), JSON (report.json, the eval's own contract) and a PNG plot."""

from __future__ import annotations

from pathlib import Path

from eyas.io import atomic_write_json

MAX_ALPHA_COLUMNS = 7


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _split(time: dict) -> str:
    """Shares of wall time in percent: draft / target / decoder bookkeeping."""
    parts = (time["draft_frac"], time["target_frac"], time["bookkeeping_frac"])
    return "-" if None in parts else "/".join(f"{100 * p:.0f}" for p in parts) + "%"


def _table(title: str):
    """A table without vertical rules: 1 column of space between cells, so 16 columns fit in 120."""
    from rich import box
    from rich.table import Table

    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                 padding=(0, 1), show_edge=False)


def _column(table, name: str, justify: str = "right", wrap: bool = False) -> None:
    """Headers never shrink below their own width; only label columns wrap, and they fold, never truncate."""
    table.add_column(name, justify=justify, min_width=len(name), no_wrap=not wrap, overflow="fold")


def _breakable(spec: str) -> str:
    """A shape or label with a space after each comma, so a narrow column wraps it between its parts."""
    return spec.replace(",", ", ")


def main_table(report: dict):
    configs = report["configs"]
    depth = min(max((len(c["overall"]["alpha"]) for c in configs), default=0), MAX_ALPHA_COLUMNS)
    settings = report["settings"]
    dtype = report["target"].get("dtype")
    title = (f"speculative decoding on {report['target']['name']}" + (f" ({dtype})" if dtype else "") +
             f": T={settings['temperature']:g}, {settings['prompts_used']} prompts x {settings['max_new_tokens']} new tokens")
    table = _table(title)
    _column(table, "draft", "left", wrap=True)
    _column(table, "shape", "left", wrap=True)
    for name in ("tau", "tau(a)"):
        _column(table, name)
    for d in range(1, depth + 1):
        _column(table, f"a{d}")
    for name in ("cum@K", "nodes", "tok/s", "speedup", "d/t/o %"):
        _column(table, name)
    if settings["temperature"] == 0 and report.get("baseline"):
        _column(table, "=greedy")
    base = report.get("baseline")
    if base:
        alone = f"target alone ({base['dtype']})" if base.get("dtype") else "target alone"
        row = [alone, "-", "1.00", "-"] + ["-"] * depth + ["-", "-", _fmt(base["overall"]["tokens_per_s"], 1),
                                                                   "1.00x", "-"]
        if settings["temperature"] == 0:
            row.append("-")
        table.add_row(*row, style="dim")
    for config in configs:
        s = config["overall"]
        alphas = (s["alpha"] + [None] * depth)[:depth]
        cum = next((c for c in reversed(s["cumulative"]) if c is not None), None)
        row = [config["draft"], _breakable(config["shape"]), _fmt(s["tau"]), _fmt(s["tau_from_alpha"])]
        row += [_fmt(a) for a in alphas]
        row += [_fmt(cum), _fmt(s["mean_tree_nodes"], 1), _fmt(s["tokens_per_s"], 1), _fmt(s["speedup"], 2, "x"),
                _split(s["time"])]
        if settings["temperature"] == 0 and base:
            match = s.get("greedy_match")
            row.append(f"{match['matched']}/{match['compared']}" if match else "-")
        table.add_row(*row)
    return table


def breakdown_table(report: dict, key: str = "per_category", title: str = "per category"):
    """tau (speedup) of every configuration per category (`per_category`) or per turn (`per_turn`)."""
    groups = sorted({g for c in report["configs"] for g in c.get(key, {})})
    table = _table(f"{title}: tau (speedup)")
    _column(table, "draft / shape", "left", wrap=True)
    for group in groups:
        _column(table, group if key == "per_category" else f"turn {group}")
    for config in report["configs"]:
        cells = []
        for group in groups:
            s = config.get(key, {}).get(group)
            cells.append("-" if s is None else f"{_fmt(s['tau'])} ({_fmt(s['speedup'], 2, 'x')})")
        table.add_row(_breakable(config["label"]), *cells)
    return table


def print_report(report: dict, console=None) -> None:
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and pipes: wide enough for the whole table
            console = Console(width=200)
    console.print(main_table(report))
    for key, title in (("per_category", "per category"), ("per_turn", "per turn")):
        if len({g for c in report["configs"] for g in c.get(key, {})}) > 1:
            console.print(breakdown_table(report, key, title))
    note = rounding_note(report)
    if note:
        console.print(note)
    skipped = report["settings"].get("skipped") or {}
    if skipped:
        console.print("skipped prompts: " + ", ".join(f"{n} {reason}" for reason, n in skipped.items()))
    console.print("tau = tokens per target verify incl. the bonus token; tau(a) = tau from the a_d; "
                  "a_d = P(accept d | 1..d-1 accepted); cum@K = P(all K accepted); "
                  "d/t/o % = shares of wall time: draft / target / other (decoder bookkeeping)")


def rounding_note(report: dict) -> str | None:
    """Why a bf16 eval's outputs may leave the target's greedy decode, where some did (None otherwise)."""
    if report["settings"]["temperature"] != 0 or report["target"].get("dtype") != "bfloat16":
        return None
    parted = [c for c in report["configs"] if (m := c["overall"].get("greedy_match")) and m["matched"] < m["compared"]]
    if not parted:
        return None
    return ("=greedy: the target runs in bfloat16, where a verify over several tokens and a 1-token decode round "
            "differently, so an output can leave the target's 1-token greedy decode at a near-tie without any draft "
            f"token being wrong ({len(parted)} of {len(report['configs'])} rows); eval.target_dtype=fp32 is exact "
            f"(precision: {report['target'].get('dtype_reason', 'bfloat16')})")


def write_json(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, report)
    return path


def plot(report: dict, path: str | Path) -> Path:
    """alpha_d and cumulative acceptance against depth, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_alpha, ax_cum) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in report["configs"]:
        s = config["overall"]
        label = f"{config['label']} (tau {_fmt(s['tau'])})"
        depths = list(range(1, len(s["alpha"]) + 1))
        alpha = [a if a is not None else float("nan") for a in s["alpha"]]
        cum = [c if c is not None else float("nan") for c in s["cumulative"]]
        ax_alpha.plot(depths, alpha, marker="o", label=label)
        ax_cum.plot(depths, cum, marker="o", label=label)
    ax_alpha.set_title("alpha_d = P(accept d | accepted 1..d-1)")
    ax_cum.set_title("cumulative: P(at least d accepted)")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_alpha, ax_cum):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft depth d")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    ax_cum.legend(fontsize=7, loc="upper right")
    settings = report["settings"]
    fig.suptitle(f"{report['target']['name']}  T={settings['temperature']:g}  "
                 f"{settings['prompts_used']} prompts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
