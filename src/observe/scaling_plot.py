"""The scaling report's plot: throughput and scaling efficiency against device count, one line
per strategy. matplotlib is imported only to draw it (training never pays for it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from src.observe.sweep_rows import Row


def scaling_figure(rows: list[Row], title: str) -> Any:
    """Throughput and scaling efficiency against device count, one line per strategy; flagged
    jobs ringed in red. The legend sits outside both plots, where it hides no point."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg renders the file

    figure = Figure(figsize=(12, 4.2), layout="constrained")
    throughput, efficiency = figure.subplots(1, 2)
    for label, points in strategy_lines(rows).items():
        devices = [row.devices for row in points]
        throughput.plot(devices, [row.samples_per_sec for row in points], "o-", label=label)
        if any(row.efficiency is not None for row in points):
            efficiency.plot(devices, [row.efficiency for row in points], "o-", label=label)
    efficiency.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="ideal")
    ring_flagged([row for row in rows if row.flags], throughput, efficiency)
    label_axes(throughput, efficiency, sorted({row.devices for row in rows}))
    handles, labels = both_legends(throughput, efficiency)
    figure.legend(handles, labels, loc="outside right upper", fontsize="small")
    figure.suptitle(title, fontsize="small")
    return figure


def strategy_lines(rows: list[Row]) -> dict[str, list[Row]]:
    """The jobs that ran, by line (strategy and variant), each line's in device order."""
    lines: dict[str, list[Row]] = {}
    for row in rows:
        if row.status == "ok":
            label = f"{row.strategy} {row.variant}".strip()
            lines.setdefault(label, []).append(row)
    for points in lines.values():
        points.sort(key=lambda row: row.devices)
    return lines


def ring_flagged(flagged: list[Row], throughput: Any, efficiency: Any) -> None:
    """A red ring around each flagged job's points."""
    for axes, value in ((throughput, "samples_per_sec"), (efficiency, "efficiency")):
        marked = [row for row in flagged if getattr(row, value) is not None]
        if not marked:
            continue
        axes.scatter(
            [row.devices for row in marked],
            [getattr(row, value) for row in marked],
            s=160,
            facecolors="none",
            edgecolors="red",
            linewidths=1.5,
            zorder=3,
            label="flagged: see summary.md",
        )


def label_axes(throughput: Any, efficiency: Any, all_devices: list[int]) -> None:
    for axes, ylabel in ((throughput, "samples/s"), (efficiency, "speed-up / devices")):
        axes.set_xlabel("devices")
        axes.set_ylabel(ylabel)
        axes.set_xticks(all_devices)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
    throughput.set_title("throughput")
    efficiency.set_title("scaling efficiency (vs single)")


def both_legends(throughput: Any, efficiency: Any) -> tuple[list, list[str]]:
    """The efficiency plot's legend entries, then the throughput plot's that it lacks."""
    handles, labels = efficiency.get_legend_handles_labels()
    known = set(labels)
    for handle, label in zip(*throughput.get_legend_handles_labels(), strict=True):
        if label not in known:  # a strategy without efficiencies (no single job to compare)
            handles.append(handle)
            labels.append(label)
    return handles, labels


def plot(rows: list[Row], path: Path, title: str) -> None:
    scaling_figure(rows, title).savefig(path, dpi=110)
