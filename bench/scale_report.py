"""The report of bench/scale.py: the targets' verdicts, its markdown, the table and figure of
docs/large-runs.md."""

from __future__ import annotations

from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]

#: what the issue asks of the report at the largest size: peak resident set and wall time
REPORT_TARGET = {"peak_rss_gb": 1.5, "wall_s": 15 * 60}



#: what it asks of ``probe run`` from the fewest to the most texts of --run-texts
RUN_GROWTH_TARGET = 1.15



#: what it asks of the readers over a tenfold step in rows (its 300 to 3,000 texts, 0.9M to 9.3M rows):
#: the peak resident set of each named command grows at most ``peak_ratio``x, the report's time at most
#: ``report_time_ratio``x (checked between the two smallest sizes of --sizes, 10^6 and 10^7 rows)
READER_GROWTH_TARGET = {"commands": ("report", "export", "headline"), "peak_ratio": 1.25, "report_time_ratio": 2.5}



FIGURE = ROOT / "docs" / "images" / "large-runs-scale.png"



DOCS = ROOT / "docs" / "large-runs.md"



def verdicts(results: dict) -> dict:
    """The issue's targets against what was measured."""
    out = {}
    runs = (results["run_memory"] or {}).get("runs", [])
    if len(runs) >= 2:
        first, last = runs[0], runs[-1]
        out["run_growth"] = {
            "texts": [first["texts"], last["texts"]],
            "peak_ratio": round(last["peak_rss_mb"] / first["peak_rss_mb"], 3),
            "run_phase_peak_ratio": round(last["run_phase_peak_rss_mb"] / first["run_phase_peak_rss_mb"], 3),
            "target": RUN_GROWTH_TARGET,
        }
        out["run_growth"]["met"] = out["run_growth"]["peak_ratio"] <= RUN_GROWTH_TARGET
    sizes = (results["scale"] or {}).get("sizes", [])
    reports = [(size["rows"], size["commands"]["report"]) for size in sizes if "report" in size["commands"]]
    if reports:
        rows, largest = max(reports, key=lambda item: item[0])
        out["report_at_largest"] = {
            "rows": rows, **largest, "target": REPORT_TARGET,
            "met": (largest["peak_rss_mb"] <= REPORT_TARGET["peak_rss_gb"] * 1000
                    and largest["wall_s"] <= REPORT_TARGET["wall_s"]),
        }
    if len(sizes) >= 2:
        small, large = sorted(sizes, key=lambda size: size["rows"])[:2]
        names = [name for name in READER_GROWTH_TARGET["commands"]
                 if name in small["commands"] and name in large["commands"]]
        peaks = {name: round(large["commands"][name]["peak_rss_mb"] / small["commands"][name]["peak_rss_mb"], 3)
                 for name in names}
        growth = {"rows": [small["rows"], large["rows"]], "peak_ratios": peaks, "target": READER_GROWTH_TARGET}
        met = all(ratio <= READER_GROWTH_TARGET["peak_ratio"] for ratio in peaks.values())
        if "report" in names:
            growth["report_time_ratio"] = round(large["commands"]["report"]["wall_s"]
                                                / small["commands"]["report"]["wall_s"], 3)
            met = met and growth["report_time_ratio"] <= READER_GROWTH_TARGET["report_time_ratio"]
        out["reader_growth"] = {**growth, "met": met}
    return out



def when(section: dict, minutes: bool = False) -> str:
    """When (the day, or with ``minutes`` the UTC time its measurement began) and under what load a section
    (or one size) was measured."""
    before, after = section.get("load_average_before"), section.get("load_average_after")
    if minutes:
        return (f"measured from {section['measured_at'][:16].replace('T', ' ')} UTC, 1-minute load average "
                f"{before[0] if before else '?'} before and {after[0] if after else '?'} after")
    return (f"measured on {section['measured_at'][:10]}, 1-minute load average {before[0] if before else '?'} before "
            f"and {after[0] if after else '?'} after")



def run_memory_lines(results: dict) -> list[str]:
    """The run's own memory at each --run-texts, as a table, and its growth against the target."""
    memory = results["run_memory"]
    settings = memory["settings"]
    lines = [
        f"`probe run` of {settings['model']} over texts of {settings['sentences']} sentences, `--max-length "
        f"{settings['max_length']}` ({when(memory)}):",
        "",
        "| texts | rows | peak resident set | of which before the final lines | wall time |",
        "|---|---|---|---|---|",
    ]
    for run in memory["runs"]:
        lines.append(f"| {run['texts']:,} | {run['rows']:,} | {run['peak_rss_mb']:,.0f} MB | "
                     f"{run['run_phase_peak_rss_mb']:,.0f} MB | {run['wall_s']:,.0f} s |")
    growth = verdicts(results).get("run_growth")
    if growth:
        lines += ["", against_target(
            f"From {growth['texts'][0]:,} to {growth['texts'][1]:,} texts the peak grows {growth['peak_ratio']:.2f}x "
            f"(the run before its final lines: {growth['run_phase_peak_ratio']:.2f}x)",
            f"at most {growth['target']}x", growth["met"])]
    return lines



def command_lines(results: dict) -> list[str]:
    """Every command's peak resident set and wall time at each size, as a table, and the report's target."""
    scale = results["scale"]
    sizes = scale["sizes"]
    commands = list(dict.fromkeys(name for size in sizes for name in size["commands"]))
    dates = {size.get("measured_at", scale["measured_at"])[:16] for size in sizes}
    measured = (when(scale) if len(dates) == 1 else "; ".join(
        f"{size['rows']:,} rows {when({**scale, **size}, minutes=True)}" for size in sizes))
    lines = [f"Readers' memory budget: {scale['settings']['memory_budget']}; {measured}.", "",
             "| command | " + " | ".join(f"{size['rows']:,} rows" for size in sizes) + " |",
             "|---|" + "---|" * len(sizes),
             "| bytes per row on disk | " + " | ".join(f"{size['bytes_per_row']:.1f}" for size in sizes) + " |"]
    for name in commands:
        cells = []
        for size in sizes:
            got = size["commands"].get(name)
            cells.append("" if got is None else f"{got['peak_rss_mb']:,.0f} MB, {got['wall_s']:,.1f} s"
                         + (" *" if "measured_at" in got else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    earlier: dict[tuple, list[str]] = {}  # (rows, when) -> the commands then
    for size in sizes:
        for name, got in size["commands"].items():
            if "measured_at" in got:
                earlier.setdefault((size["rows"], when(got, minutes=True)), []).append(name)
    if earlier:
        lines += ["", "\\* kept from an earlier measurement of the same run sizes: " + "; ".join(
            f"at {rows:,} rows, {', '.join(names)}, {measured}" for (rows, measured), names in earlier.items()) + "."]
    report = verdicts(results).get("report_at_largest")
    if report:
        target = report["target"]
        lines += ["", against_target(
            f"The report at {report['rows']:,} rows: {report['peak_rss_mb']:,.0f} MB, {report['wall_s']:,.0f} s",
            f"at most {target['peak_rss_gb']} GB and {target['wall_s'] // 60} minutes", report["met"])]
    growth = verdicts(results).get("reader_growth")
    if growth:
        target = growth["target"]
        ratios = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in growth["peak_ratios"].items())
        time_ratio = (f", and the report's time grows {growth['report_time_ratio']:.2f}x"
                      if "report_time_ratio" in growth else "")
        lines += ["", against_target(
            f"From {growth['rows'][0]:,} to {growth['rows'][1]:,} rows the peak resident set grows: {ratios}"
            f"{time_ratio}", f"at most {target['peak_ratio']}x for the memory and {target['report_time_ratio']}x "
            "for the time", growth["met"])]
    return lines



def against_target(measured: str, target: str, met: bool) -> str:
    return f"{measured}; the target is {target}: {'met' if met else '**not met**'}."



def docs_block(results: dict) -> str:
    """What docs/large-runs.md shows of the results, between its ``scale:table`` markers."""
    lines = []
    if results["scale"]:
        lines += ["**Every command** on runs of each size, peak resident set and wall time:", "",
                  *command_lines(results), ""]
    if results["run_memory"]:
        lines += ["**The run's own memory.**", "", *run_memory_lines(results), ""]
    env = results["environment"]
    lines.append(f"Machine: {env['machine']}, {env['cores']} cores shared with other work.")
    return "\n".join(lines)



def markdown(results: dict) -> str:
    lines = [
        "# Scale: memory and time of every command against the number of rows",
        "",
        common.header(results) + " Peak resident set of each command's own process, and wall time; each section "
        "and each size carries its own date and load.",
        "",
    ]
    if results["run_memory"]:
        lines += ["## The run's own memory", "", *run_memory_lines(results), ""]
    if results["scale"]:
        real = results["scale"]["real_run"]
        made = (f"`probe run` {real['wall_s']:,.0f} s at {real['peak_rss_mb']:,.0f} MB" if "wall_s" in real
                else f"given: {real['given']}")
        lines += [
            "## Every command against the run's size",
            "",
            f"The smallest run is real ({real['texts']:,} texts of two sentences, {real['rows']:,} rows, {made}); the "
            "larger ones are its parts replicated through the real writer.",
            "",
            *command_lines(results),
            "",
        ]
    return "\n".join(lines)



def publish(results: dict) -> None:
    """The figure and the table of docs/large-runs.md, from the results."""
    if results["scale"]:
        draw_figure(results, FIGURE)
    common.fill_markers(DOCS, {"scale:table": "\n" + docs_block(results) + "\n"})



def draw_figure(results: dict, path: Path) -> None:
    """Peak resident set and wall time of each command against the rows (log-log), from the results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    sizes = results["scale"]["sizes"]
    commands = list(dict.fromkeys(name for size in sizes for name in size["commands"]))
    figure, (memory, seconds) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for name in commands:
        points = [(size["rows"], size["commands"][name]) for size in sizes if name in size["commands"]]
        rows = [row for row, _ in points]
        memory.plot(rows, [got["peak_rss_mb"] / 1000 for _, got in points], marker="o", label=name)
        seconds.plot(rows, [got["wall_s"] for _, got in points], marker="o", label=name)
    memory.axhline(REPORT_TARGET["peak_rss_gb"], color="grey", linestyle="--", linewidth=1, label="the report's target")
    seconds.axhline(REPORT_TARGET["wall_s"], color="grey", linestyle="--", linewidth=1, label="the report's target")
    for axis, label in ((memory, "peak resident set (GB)"), (seconds, "wall time (s)")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("rows in the run")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_formatter(NullFormatter())
    seconds.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
