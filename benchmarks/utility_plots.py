"""PNG plots of the SST-2 utility records (`python -m benchmarks.utility --plots`); matplotlib: `pip install
-e ".[bench]"`. Draws only from the records file; for each (method, ε target) the latest record counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MARKERS = "osD^v<>ph*"


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


def _accuracy(plt, chosen, methods, colors, path: Path, subtitle: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (method, label) in enumerate(methods):
        points = sorted((eps, r["dev_accuracy"]) for (m, eps), r in chosen.items() if m == method and eps is not None)
        if points:
            ax.plot(*zip(*points), marker=MARKERS[i % len(MARKERS)], color=colors[method], label=label)
        twin = chosen.get((method, None))
        if twin is not None:
            ax.axhline(twin["dev_accuracy"], color=colors[method], linestyle="--", linewidth=1,
                       label=f"{label}: non-private")
    epsilons = sorted({eps for (_, eps) in chosen if eps is not None})
    if epsilons:
        ax.set_xscale("log")
        ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
        ax.minorticks_off()
    majority = max((r.get("eval_majority_accuracy") or 0.5) for r in chosen.values())
    ax.axhline(majority, color="grey", linewidth=0.8, linestyle=":", label=f"majority class ({majority:.3f})")
    ax.set_xlabel("ε (target; δ = 1/(2N))")
    ax.set_ylabel("dev accuracy")
    ax.set_title(f"Accuracy vs ε\n{subtitle}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _epsilon(plt, chosen, methods, colors, path: Path, subtitle: str) -> Path | None:
    styles = ["-", "--", ":", "-."]
    private = sorted(((m, eps) for (m, eps) in chosen if eps is not None), key=lambda k: (k[0], -k[1]))
    if not private:
        return None
    targets = sorted({eps for _, eps in private}, reverse=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = dict(methods)
    order = [m for m, _ in methods]
    for method, eps in private:
        curve = chosen[(method, eps)].get("epsilon_curve") or []
        if curve:  # methods with equal B and epochs have equal curves: wider lines underneath keep both visible
            steps, values = zip(*([[0, 0.0]] + curve))
            ax.plot(steps, values, color=colors[method], linestyle=styles[targets.index(eps) % len(styles)],
                    linewidth=1.2 + 1.5 * (len(order) - 1 - order.index(method)),
                    label=f"{labels[method]}, target ε={eps:g}")
    ax.set_xlabel("training step (logical batch)")
    ax.set_ylabel("ε spent (PRV accountant, exact per step)")
    ax.set_title(f"ε vs training step\n{subtitle.replace(', dev accuracy', '')}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cost(plt, chosen, methods, colors, path: Path, subtitle: str) -> Path:
    settings = sorted({eps for (_, eps) in chosen}, key=lambda e: (e is None, -(e or 0)))
    names = ["non-private" if e is None else f"ε={e:g}" for e in settings]
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / max(1, len(settings))
    for j, (eps, name) in enumerate(zip(settings, names)):
        for i, (method, _) in enumerate(methods):
            record = chosen.get((method, eps))
            if record is None:
                continue
            x = i + (j - (len(settings) - 1) / 2) * width
            hatch = "//" if eps is None else None
            alpha = 1.0 - 0.5 * j / max(1, len(settings))
            time_ax.bar(x, record["cpu_seconds"] / 60, width, color=colors[method], alpha=alpha, hatch=hatch,
                        label=name if i == 0 else None)
            memory_ax.bar(x, record["peak_memory_bytes"] / 2**30, width, color=colors[method], alpha=alpha,
                          hatch=hatch)
    # CPU time of the run's own process: unlike wall time it does not depend on what else the machine runs
    for ax, ylabel in ((time_ax, "CPU time of the run (min)"), (memory_ax, "peak memory (GiB)")):
        ax.set_xticks(range(len(methods)), [label for _, label in methods], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    time_ax.legend(fontsize=8)
    kinds = sorted({r["memory_kind"] for r in chosen.values()})
    memory_ax.set_title(", ".join(kinds), fontsize=9)
    time_ax.set_title("bars per method: " + ", ".join(names), fontsize=9)
    fig.suptitle(f"Time and peak memory per method\n{subtitle.replace(', dev accuracy', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_table(records: list[dict[str, Any]], order: list[str] | None = None) -> str:
    """The README's table: dev accuracy per method at each ε and non-privately (the latest record of each), whether
    each private run's loss fell, and the cost of the ε = 8 run against its twin. Methods in `order` come first."""
    chosen = latest(records)
    rank = {name: i for i, name in enumerate(order or [])}
    epsilons = sorted({eps for _, eps in chosen if eps is not None}, reverse=True)
    head = ["method", "non-private", *(f"ε = {eps:g}" for eps in epsilons), "loss start → end (ε = 8)",
            "CPU-min (ε = 8 / non-private)", "peak MiB (ε = 8 / non-private)"]
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
