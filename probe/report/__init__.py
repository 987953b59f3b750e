"""The report: a run directory -> figures, ``summary.csv`` / ``summary.json`` and ``index.html``; and
``probe compare``, which overlays several runs.

One idea per module:

* :mod:`.data`: reading the run (table file or directory of part files, manifest, provenance, the
  main (space, alpha) slice, trivial rows);
* :mod:`.summary`: the statistics (three levels) and the headline numbers;
* :mod:`.findings`: the token role, query position, token and head that deviate most;
* :mod:`.style`: drawing primitives, shared bins and scales, saving (TrueType fonts in PDFs);
* :mod:`.figures`: the deviation figures (overview, layers, heads, heatmaps);
* :mod:`.breakdowns`: by token role, query position and likely drivers;
* :mod:`.quantities`: across alphas and spaces, and the other measured quantities;
* :mod:`.explorer` and :mod:`.page`: the interactive, self-contained page;
* :mod:`.text_view`: one text at one site and head, its attention against the exact posterior (``probe show``,
  and the page's section on the worst row);
* :mod:`.compare`: several runs on shared axes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from probe.core.destination import check_destination, check_replaceable, writing, written_whole
from probe.core.environment import check_environment
from probe.core.errors import ProbeError
from probe.core.spelling import option
from probe.report import explorer
from probe.report.breakdowns import drivers_figure, positions_figure, roles_figure
from probe.report.compare import compare_runs
from probe.report.data import ReportRun, read_run, require_run_dir
from probe.report.figures import (
    heads_figure,
    heatmap_figure,
    layers_figure,
    overview_figure,
    report_scale,
)
from probe.report.findings import analyse as compute_findings
from probe.report.page import page
from probe.report.quantities import (
    alpha_figure,
    quantity_figure,
    second_order_figure,
    spaces_figure,
)
from probe.report.style import FORMATS, Drawn, Scale, check_formats, save, style
from probe.report.summary import (
    control_headline,
    main_rows,
    quantity_stats,
    summarize,
    summary_json,
)
from probe.report.text_view import TextView, view_figure, worst_row
from probe.report.text_view import section_html as text_view_section

__all__ = ["FORMATS", "Drawn", "build_report", "compare_runs", "draw_figures", "read_run"]


def draw_figures(run: ReportRun, summary, scale: Scale):
    """Every figure of the report, in page order (a generator of :class:`Drawn`; call inside ``style()``).

    Figures whose data is absent (no ``token_role``, one alpha, a quantity not computed) are skipped.
    """
    head_stats = main_rows(summary, run, "head")
    yield overview_figure(run, scale)
    optional = [roles_figure(run, scale), alpha_figure(run), spaces_figure(run, scale)]
    yield from (drawn for drawn in optional if drawn is not None)
    for attention_type in run.types:
        yield layers_figure(run, attention_type, scale)
        yield heatmap_figure(run, head_stats, "mean", attention_type, scale)
        yield heatmap_figure(run, head_stats, "p95", attention_type, scale)
        for drawn in (positions_figure(run, attention_type, scale), drivers_figure(run, attention_type, scale)):
            if drawn is not None:
                yield drawn
        yield heads_figure(run, attention_type, scale)
    for drawn in (second_order_figure(run, scale), quantity_figure(run, "attention_tv"),
                  quantity_figure(run, "output_deviation")):
        if drawn is not None:
            yield drawn


def _interventions_section(run: ReportRun, out_dir: Path, formats, allow_damaged: bool) -> str:
    """The interventions section of a run with ``--intervene`` (its figure and ``interventions.csv`` written
    into ``out_dir``); "" for a run without."""
    from probe.report import interventions
    from probe.report.page import figure_html

    records = interventions.open_interventions(run.run_dir, run.manifest, allow_damaged=allow_damaged,
                                               connection=run.table.connection)
    if records is None:
        return ""
    table, facts = interventions.effects(records)
    if table.empty:
        return ""
    table.to_csv(out_dir / "interventions.csv", index=False)
    with style():
        drawn = save(interventions.figure(table, run.name), out_dir, formats)
    return interventions.section_html(table, facts, figure_html(drawn))


def _control(run: ReportRun, control: str | Path | None) -> dict | None:
    """The control run's headline numbers (:func:`probe.report.summary.control_headline`): the one given, else
    the one the manifest's ``control`` names (relative to the run directory; a note on the page when it is
    gone); None without either."""
    if control is None:
        named = run.manifest.get("control") if isinstance(run.manifest, dict) else None
        if not isinstance(named, str) or not named.strip():
            return None
        path = run.run_dir / named
        if not path.is_dir():
            run.notes.append(f"The manifest names the control run {named}, which is not there "
                             f"({path}); the page shows no control numbers.")
            return None
        control = path
    try:
        return control_headline(run, control)
    except ProbeError as error:
        raise ProbeError(f"The control run ({option('control')}) cannot be read: {error}") from None


class Progress:
    """``probe report: ...`` stage lines on stderr (silent unless ``enabled``), each with the seconds since
    the report started."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"probe report: {message} ({time.perf_counter() - self.start:.1f} s)", file=sys.stderr, flush=True)


def build_report(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    formats: Sequence[str] = ("png",),
    *,
    name: str | None = None,
    allow_damaged: bool = False,
    progress: bool = False,
    control: str | Path | None = None,
    text_view: Callable[[dict], TextView] | None = None,
) -> Path:
    """Build figures, ``summary.csv``, ``summary.json`` and ``index.html`` for a run; return the report directory.

    ``out_dir`` defaults to ``<run_dir>/report``; ``formats`` are figure formats (``png``, ``pdf``; the
    page embeds PNG renderings whatever is written); ``name`` overrides the model's name in titles;
    ``progress`` prints each stage on stderr; ``control``: a control run's directory (a random-initialisation
    run of the same model, say), whose headline numbers the first screen shows beside the run's (default:
    the run directory the manifest's ``control`` names, relative to the run directory); ``text_view``: a function
    that gives the :class:`probe.report.text_view.TextView` of a row's text, site and head (the API's, which
    recomputes it from the model's files: :func:`probe.pipeline.recompute.text_view`), for the section on the
    worst row (None: no such section; a :class:`ProbeError` it raises is said in the section).  Every number is
    asked of the rows through :mod:`probe.query`, so memory stays within the readers' budget
    (``PROBE_MEMORY_BUDGET``) whatever the rows.  The report is written whole or not at all
    (:func:`probe.core.destination.written_whole`): ``out_dir`` holds the previous report until the new one is
    complete, and a folder that holds anything but an earlier report is refused.  Raises :class:`ProbeError` for a missing run directory, a
    missing, unreadable or incomplete deviations table and unknown formats.  A missing or invalid
    ``manifest.json`` only warns; a table without rows gives a report that says there is no data.
    """
    check_environment()
    formats = check_formats(formats)
    run_dir = require_run_dir(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    say = Progress(progress)
    if control is not None and not Path(control).is_dir():  # said before the run is read
        raise ProbeError(f"The control run {control} ({option('control')}) does not exist or is not a directory. "
                         "Pass the run directory printed by `probe run --init random`, or leave it out.")
    if out_dir.exists() and not out_dir.is_dir():
        raise ProbeError(f"Report directory {out_dir} exists and is not a directory. "
                         f"Choose another {option('out')}.")
    check_replaceable(out_dir, "out", "report", REPORT_MARKER)
    check_destination(out_dir, "out")  # before the run is read: writable, with room
    run = read_run(run_dir, name=name, allow_damaged=allow_damaged)
    with writing("the report", out_dir), written_whole(out_dir) as staging:
        _build(run, run_dir, staging, formats, control, allow_damaged, say, text_view)
    say(f"wrote {out_dir / 'index.html'}")
    return out_dir


#: the file every report holds (its first): a folder with it is an earlier report, which a new one replaces whole
REPORT_MARKER = "summary.json"


def _worst_text(run: ReportRun, out_dir: Path, formats, text_view, say) -> str:
    """The section on the worst row: the text view of its text, site and head (written as ``text_*`` figures),
    or why there is none."""
    from probe.report.page import figure_html

    row = worst_row(run)
    if row is None:
        return ""
    try:
        view = text_view(row)
    except ProbeError as error:
        return text_view_section("", row, str(error))
    with style():
        saved = save(view_figure(view), out_dir, formats)
    say(f"the worst row's text, recomputed from the model's files: {saved.stem}")
    return text_view_section(figure_html(saved), row, None)


def _build(run, run_dir: Path, out_dir: Path, formats, control, allow_damaged: bool, say, text_view=None) -> None:
    """The report's files, written into ``out_dir`` (the hidden folder :func:`build_report` moves into place)."""
    try:
        counts = run.counts(main=False)
        say(f"read {run_dir} ({counts['rows']:,} rows in {len(run.table.files):,} part file(s), "
            f"{len(run.types)} attention type(s))")
        control_numbers = _control(run, control)
        summary = summarize(run)
        say("statistics: summary.csv (" + ("exact quantiles" if run.aggregates is None else
                                           f"quantiles of the kept sketches, rank error {run.rank_error:.4f}")
            + " at every level)")
        found, below_noise = compute_findings(run)
        quantities = quantity_stats(run)
        say("findings and the other measured quantities")
        out_dir.mkdir(parents=True, exist_ok=True)
        summary.to_csv(out_dir / "summary.csv", index=False)
        summary_data = summary_json(run, summary, found, below_noise, control_numbers)
        (out_dir / "summary.json").write_text(json.dumps(summary_data, indent=1, allow_nan=False), encoding="utf-8")
        saved, explorer_html, explorer_data = [], "<p>No data.</p>", None
        if run.counts()["rows"] > run.counts()["trivial"]:
            head_stats = main_rows(summary, run, "head")
            scale = report_scale(run, head_stats)
            with style():
                for drawn in draw_figures(run, summary, scale):
                    saved.append(save(drawn, out_dir, formats))
                    say(f"figure {len(saved)}: {drawn.stem}")
            explorer_data = explorer.payload(run, head_stats, scale, explorer.recover_texts(run.manifest))
            explorer_html = (
                explorer.filters(run)
                + '<div class="explorer"><div>' + explorer.heatmap_tables(run, head_stats, scale) + "</div>"
                + explorer.HEAD_PANEL + "</div>"
            )
            say("explorer: worst rows and per-head histograms")
        section = _interventions_section(run, out_dir, formats, allow_damaged)
        worst = "" if text_view is None or explorer_data is None else _worst_text(run, out_dir, formats, text_view,
                                                                                  say)
        html_text = page(run, summary, found, saved, explorer_html, explorer_data, quantities, section,
                         control_numbers, worst)
        (out_dir / "index.html").write_text(html_text, encoding="utf-8")
    finally:
        run.table.close()
