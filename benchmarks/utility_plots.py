"""PNG plots of the SST-2 utility records (`python -m benchmarks.utility --plots`); matplotlib: `pip install
-e ".[bench]"`. Draws only from the records file; for each (method, ε target) the latest record counts."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

MARKERS = "osD^v<>ph*"
LINESTYLES = ("-", "--", "-.", ":")


def latest(records: list[dict[str, Any]]) -> dict[tuple[str, float | None], dict[str, Any]]:
    """The last record per (method, ε target): a re-run with changed hyperparameters supersedes the older one."""
    chosen = {}
    for record in records:
        if record.get("eval_split", "dev") == "dev":  # runs evaluated on a train hold-out (tuning) are not plotted
            chosen[(record["method"], record["epsilon_target"])] = record
    return chosen


def _methods(chosen) -> list[tuple[str, str]]:
    seen = {}
    for (method, _), record in chosen.items():
        seen.setdefault(method, record["label"])
    return list(seen.items())


def draw_all(records: list[dict[str, Any]], out_dir: Path, stem: str = "utility_sst2") -> list[Path]:
    if not records:
        print("No records to plot.")
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = latest(records)
    if not chosen:
        print("No records evaluated on dev to plot.")
        return []
    methods = _methods(chosen)
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, (m, _) in enumerate(methods)}
    subtitle = _subtitle(chosen)
    paths = [
        _accuracy(plt, chosen, methods, colors, out_dir / f"{stem}_accuracy.png", subtitle),
        _epsilon(plt, chosen, methods, colors, out_dir / f"{stem}_epsilon.png", subtitle),
        _cost(plt, chosen, methods, colors, out_dir / f"{stem}_cost.png", subtitle),
    ]
    return [p for p in paths if p is not None]


def _subtitle(chosen) -> str:
    sizes = sorted({r["train_size"] for r in chosen.values()})
    model = next(iter(chosen.values()))["model"].split("/")[-1]
    return f"SST-2, {model}, train {'/'.join(f'{s:,}' for s in sizes)} sentences, dev accuracy"


def _spread(index: int, count: int) -> float:
    """A factor that moves method `index` of `count` slightly sideways on a log axis: equal values stay visible."""
    return 10 ** (0.03 * (index - (count - 1) / 2))


def _legend_outside(ax, **kwargs) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, **kwargs)


def _accuracy(plt, chosen, methods, colors, path: Path, subtitle: str) -> Path:
    """Each method's private accuracies against ε, and its non-private twin at a position of its own on the right
    (hollow marker): horizontal lines for the twins hid each other and the private points."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    epsilons = sorted({eps for (_, eps) in chosen if eps is not None})
    twin_x = (epsilons[-1] if epsilons else 1.0) * 3
    for i, (method, label) in enumerate(methods):
        shift, marker = _spread(i, len(methods)), MARKERS[i % len(MARKERS)]
        points = sorted((eps, r["dev_accuracy"]) for (m, eps), r in chosen.items() if m == method and eps is not None)
        if points:
            ax.plot(
                [eps * shift for eps, _ in points],
                [a for _, a in points],
                marker=marker,
                color=colors[method],
                linestyle=LINESTYLES[i % len(LINESTYLES)],
                alpha=0.85,
                label=label,
            )
        twin = chosen.get((method, None))
        if twin is not None:
            ax.plot(
                [twin_x * shift],
                [twin["dev_accuracy"]],
                marker=marker,
                color=colors[method],
                markerfacecolor="white",
                markeredgewidth=1.5,
                linestyle="none",
                label=f"{label}: non-private",
            )
    ticks = {eps: f"{eps:g}" for eps in epsilons}
    if any(eps is None for (_, eps) in chosen):
        ticks[twin_x] = "non-private"
    ax.set_xscale("log")
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.set_xlim(min(ticks) / 1.6, max(ticks) * 1.6)  # room for the sideways spread of the outer methods
    ax.minorticks_off()
    majority = max((r.get("eval_majority_accuracy") or 0.5) for r in chosen.values())
    ax.axhline(majority, color="grey", linewidth=0.8, linestyle=":", label=f"majority class ({majority:.3f})")
    ax.set_ylim(bottom=min(majority, *(r["dev_accuracy"] for r in chosen.values())) - 0.02)  # the line off the frame
    ax.set_xlabel("ε (target; δ = 1/(2N)); methods drawn slightly apart where their points coincide")
    ax.set_ylabel("dev accuracy")
    ax.set_title(f"Accuracy vs ε\n{subtitle}", fontsize=10)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _epsilon(plt, chosen, methods, colors, path: Path, subtitle: str) -> Path | None:
    """ε against step per target. Methods with the same B, epochs and σ have the same curve: one line names them all
    (drawn once, nothing hides behind it)."""
    targets = sorted({eps for (_, eps) in chosen if eps is not None}, reverse=True)
    if not targets:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = dict(methods)
    for t, eps in enumerate(targets):
        curves: dict[tuple, list[str]] = {}  # the curve, rounded → the methods that have it
        for method, _ in methods:
            curve = (chosen.get((method, eps)) or {}).get("epsilon_curve") or []
            if curve:
                curves.setdefault(tuple((step, round(value, 6)) for step, value in curve), []).append(method)
        for g, (curve, group) in enumerate(curves.items()):
            steps, values = zip(*([(0, 0.0), *curve]))
            names = textwrap.fill(", ".join(labels[m] for m in group), 45, break_on_hyphens=False)
            ax.plot(
                steps,
                values,
                color=colors[group[0]] if len(group) == 1 else "black",
                linestyle=LINESTYLES[t % len(LINESTYLES)],
                marker=MARKERS[g % len(MARKERS)],
                markersize=4,
                alpha=0.85,
                label=f"target ε={eps:g}: {names}",
            )
    ax.set_xlabel("training step (logical batch)")
    ax.set_ylabel("ε spent (PRV accountant, exact per step)")
    ax.set_title(f"ε vs training step\n{subtitle.replace(', dev accuracy', '')}", fontsize=10)
    ax.grid(alpha=0.3)
    _legend_outside(ax, labelspacing=0.8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _cost(plt, chosen, methods, colors, path: Path, subtitle: str) -> Path:
    from matplotlib.patches import Patch

    settings = sorted({eps for (_, eps) in chosen}, key=lambda e: (e is None, -(e or 0)))
    names = ["non-private" if e is None else f"ε={e:g}" for e in settings]
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / max(1, len(settings))
    shades = [1.0 - 0.5 * j / max(1, len(settings)) for j in range(len(settings))]
    for j, eps in enumerate(settings):
        for i, (method, _) in enumerate(methods):
            record = chosen.get((method, eps))
            if record is None:
                continue
            x = i + (j - (len(settings) - 1) / 2) * width
            style = dict(color=colors[method], alpha=shades[j], hatch="//" if eps is None else None)
            time_ax.bar(x, record["cpu_seconds"] / 60, width, **style)
            memory_ax.bar(x, record["peak_memory_bytes"] / 2**30, width, **style)
    # CPU time of the run's own process: unlike wall time it does not depend on what else the machine runs
    for ax, ylabel in ((time_ax, "CPU time of the run (min)"), (memory_ax, "peak memory (GiB)")):
        ax.set_xticks(range(len(methods)), [label for _, label in methods], fontsize=8, rotation=25, ha="right")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    kinds = sorted({r["memory_kind"] for r in chosen.values()})
    memory_ax.set_title(", ".join(kinds), fontsize=9)
    time_ax.set_title("bars per method, left to right: " + ", ".join(names), fontsize=9)
    handles = [
        Patch(facecolor="grey", alpha=shades[j], hatch="//" if eps is None else None, label=name)
        for j, (eps, name) in enumerate(zip(settings, names))
    ]
    _legend_outside(memory_ax, handles=handles)
    fig.suptitle(f"Time and peak memory per method\n{subtitle.replace(', dev accuracy', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def markdown_table(records: list[dict[str, Any]], order: list[str] | None = None) -> str:
    """The table of docs/benchmarks.md: dev accuracy per method at each ε and non-privately (the latest record of
    each), whether each private run's loss fell, and the cost of the ε = 8 run against its twin. Methods in `order`
    come first."""
    chosen = latest(records)
    rank = {name: i for i, name in enumerate(order or [])}
    epsilons = sorted({eps for _, eps in chosen if eps is not None}, reverse=True)
    head = [
        "method",
        "non-private",
        *(f"ε = {eps:g}" for eps in epsilons),
        "loss start → end (ε = 8)",
        "CPU-min (ε = 8 / non-private)",
        "peak MiB (ε = 8 / non-private)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, label in sorted(_methods(chosen), key=lambda m: rank.get(m[0], len(rank))):
        twin = chosen.get((method, None))
        cells = [label, "–" if twin is None else f"{twin['accuracy']:.1%}"]
        for eps in epsilons:
            run = chosen.get((method, eps))
            if run is None:
                cells.append("–")
                continue
            gap = "" if twin is None else f" ({100 * (run['accuracy'] - twin['accuracy']):+.1f})"
            cells.append(f"{run['accuracy']:.1%}{gap}{' loss rose' if run.get('loss_rose') else ''}")
        at8 = chosen.get((method, 8.0))
        cells.append("–" if at8 is None else f"{at8['loss_start']:.3f} → {at8['loss_end']:.3f}")
        cells.append(_pair(at8, twin, lambda r: f"{r['cpu_seconds'] / 60:.1f}"))
        cells.append(_pair(at8, twin, lambda r: f"{r['peak_memory_bytes'] / 2**20:.0f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pair(private: dict[str, Any] | None, twin: dict[str, Any] | None, show) -> str:
    return " / ".join("–" if r is None else show(r) for r in (private, twin))


#: what a method's records train, as the arms table names it (the others by their label)
TRAINING_MODES = {"lora": "LoRA", "dpsgd": "full"}


def arm_label(record: dict[str, Any]) -> str:
    """A run's arm: what it trains (LoRA or the full model), its noise mechanism, clip rule (the fixed C, or adaptive
    with its target quantile) and lr."""
    options = record.get("options") or {}
    lr = f", lr {record['hyperparameters']['lr']:g}"
    mechanism = options.get("noise_mechanism", "dp-sgd")
    noise = {"dp-sgd": "DP-SGD", "band-mf": "BandMF", "band-inv-mf": "banded inverse"}.get(mechanism, mechanism)
    noise = f"{TRAINING_MODES.get(record['method'], record['label'])}: {noise}"
    if "bands" in options:
        noise += f" (bands={options['bands']})"
    if options.get("max_grad_norm") == "adaptive":
        return f"{noise}, adaptive C (quantile {options.get('target_quantile', 0.5):g}){lr}"
    return f"{noise}, C = {record['max_grad_norm']:g}{lr}"


def arms_table(records: list[dict[str, Any]]) -> str:
    """Dev accuracy per arm (noise mechanism and clip rule, `arm_label`) and ε, each cell the mean over the seeds
    run, with every seed's accuracy, the bands BandMF chose and where adaptive C ended: the correlated-noise and
    adaptive-clipping comparison of docs/benchmarks.md. Every record counts (seeds are replicates, not re-runs)."""
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    first: dict[str, dict[str, Any]] = {}  # each arm's first record, to order the rows
    for record in records:
        if record.get("private") and record.get("eval_split", "dev") == "dev":
            cells.setdefault((arm_label(record), record["epsilon_target"]), []).append(record)
            first.setdefault(arm_label(record), record)
    epsilons = sorted({eps for _, eps in cells}, reverse=True)
    method_order = list(dict.fromkeys(record["method"] for record in first.values()))
    arms = sorted(first, key=lambda arm: _arm_order(first[arm], method_order))
    lines = ["| arm | " + " | ".join(f"ε = {eps:g}" for eps in epsilons) + " |", "|" + "---|" * (len(epsilons) + 1)]
    for arm in arms:
        row = [arm]
        for eps in epsilons:
            runs = cells.get((arm, eps), [])
            row.append(_arm_cell(runs) if runs else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _arm_order(record: dict[str, Any], method_order: list[str]) -> tuple[Any, ...]:
    """Rows by method, then DP-SGD's fixed C, adaptive C, BandMF, the banded inverse; each by C and lr."""
    options = record.get("options") or {}
    mechanism = ("dp-sgd", "band-mf", "band-inv-mf").index(options.get("noise_mechanism", "dp-sgd"))
    adaptive = options.get("max_grad_norm") == "adaptive"
    lr, clip = record["hyperparameters"]["lr"], record["max_grad_norm"]
    return (method_order.index(record["method"]), mechanism, adaptive, options.get("target_quantile", 0), clip, lr)


def _arm_cell(runs: list[dict[str, Any]]) -> str:
    accuracies = [r["accuracy"] for r in runs]
    cell = f"{sum(accuracies) / len(accuracies):.1%}"
    if len(runs) > 1:
        cell += " (" + ", ".join(f"{a:.1%}" for a in accuracies) + ")"
    notes = []
    chosen = sorted({r["band_mf"]["bands"] for r in runs if (r.get("band_mf") or {}).get("bands_chosen_by") == "auto"})
    if chosen:
        notes.append("b = " + "/".join(map(str, chosen)))
    ends = [r["adaptive_clipping"]["final_max_grad_norm"] for r in runs if r.get("adaptive_clipping")]
    if ends:
        start = runs[0]["adaptive_clipping"]["initial_max_grad_norm"]
        notes.append(f"C {start:.2f} → " + "/".join(f"{c:.2f}" for c in ends))
    if any(r.get("loss_rose") for r in runs):
        notes.append("loss rose")
    return cell + (f"; {', '.join(notes)}" if notes else "")
