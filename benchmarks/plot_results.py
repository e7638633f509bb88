"""Draw the benchmark charts of docs/benchmarks.md from benchmarks/results.json.

Map: ``load`` reads the recorded figures (copied by hand from RESULTS.md, with card and date);
one function per chart writes an SVG into docs/img/. Run ``python benchmarks/plot_results.py``
after changing results.json, and commit the SVGs.
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "docs", "img")
OURS, STOCK, FLOOR = "#1f77b4", "#bbbbbb", "#2ca02c"


def load() -> dict:
    with open(os.path.join(HERE, "results.json"), encoding="utf-8") as f:
        return json.load(f)


def _save(fig, name: str) -> str:
    path = os.path.join(OUT, name)
    # a fixed hash salt and no date keep the SVG byte-identical across runs
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)
    return path


def _provenance(entry: dict) -> str:
    """Card, torch version, world size, date and run, as the chart titles show them."""
    card, torch_version = entry["card"].split(", ")[:2]
    world = entry["world_size"]
    ranks = f"{world} rank" + ("s" if world != 1 else "")
    run = f", {entry['run']}" if entry["run"].startswith("run") else ""
    return f"{card.replace('NVIDIA ', '')}, {torch_version}, {ranks}, {entry['date']}{run}"


def stats_chart(r: dict) -> str:
    s = r["stats"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(s["x_floor"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(s["sets"]))]
        color = OURS if name.startswith("mfsdp") else STOCK
        bars = ax.bar(
            xs,
            s["x_floor"][name],
            width,
            label=name,
            color=color,
            hatch="" if i < 2 else "//",
            edgecolor="#555555",
        )
        ax.bar_label(bars, fmt="%.1fx", fontsize=8)
    ax.axhline(1.0, color=FLOOR, linestyle="--", linewidth=1, label="hardware floor (1x)")
    ax.set_yscale("log")
    ax.set_ylim(0.5, 300)
    ax.set_xticks(range(len(s["sets"])), [f"{n} grads" for n in s["sets"]])
    ax.set_ylabel("time / floor (log)")
    ax.set_title(
        f"Global grad norm: time over the floor ({_provenance(s)})",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, "bench_stats.svg")


def step_chart(r: dict) -> str:
    s = r["step"]
    labels, values = list(s["ms"]), list(s["ms"].values())
    colors = [FLOOR, STOCK, OURS, STOCK]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    bars = ax.barh(labels[::-1], values[::-1], color=colors[::-1], edgecolor="#555555")
    floor = s["ms"]["hardware floor"]
    ax.bar_label(
        bars,
        labels=[f"{v:.2f} ms ({v / floor:.2f}x floor)" for v in values[::-1]],
        fontsize=8,
        padding=3,
    )
    ax.set_xlim(0, max(values) * 1.45)
    ax.set_xlabel("ms per step")
    ax.set_title(f"AdamW step with clipping, 1.2B params\n({_provenance(s)})", fontsize=10)
    return _save(fig, "bench_step.svg")


def checkpoint_chart(r: dict) -> str:
    c = r["checkpoint"]
    runs = list(c["runs"])
    metrics = list(c["runs"][runs[0]])
    fig, ax = plt.subplots(figsize=(7, 2.8))
    width = 0.35
    for i, metric in enumerate(metrics):
        xs = [j + (i - 0.5) * width for j in range(len(runs))]
        bars = ax.bar(
            xs,
            [c["runs"][run][metric] for run in runs],
            width,
            label=metric,
            color=OURS if i == 0 else "#9ecae1",
            edgecolor="#555555",
        )
        ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.0, color="#d62728", linestyle="--", linewidth=1, label="stock torch (1x)")
    ax.set_xticks(range(len(runs)), runs)
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("x stock (lower is better)")
    ax.set_title(
        f"Optimizer checkpoints against stock torch (CPU, gloo, {c['date']}, latest runs)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper center", ncol=3, bbox_to_anchor=(0.5, -0.18))
    return _save(fig, "bench_checkpoint.svg")


def main() -> None:
    plt.rcParams["svg.hashsalt"] = "mfsdp-optim"
    results = load()
    for chart in (stats_chart, step_chart, checkpoint_chart):
        print(chart(results))


if __name__ == "__main__":
    main()
