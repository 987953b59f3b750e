"""The figures of a series over training (:mod:`probe.report.series`): the step is a whole number, so its axis
has whole-number ticks (a tick at each step when there are few), and the per-layer legend sits beside the
panels, over none of their lines."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from probe.report.series import SERIES_COLUMNS, STATISTICS, series_figure
from probe.report.style import style


def series(steps: list[int], layers: int, types=("self",)) -> pd.DataFrame:
    """A series.csv-like table: the whole model and each layer at every step, with their intervals."""
    rng = np.random.default_rng(0)
    records = []
    for attention_type in types:
        for step in steps:
            for layer in [None, *range(layers)]:
                record = {"step": step, "run": f"step{step}", "run_dir": f"r{step}", "attention_type": attention_type,
                          "layer": layer, "examples": 6, "count": 100}
                for statistic in STATISTICS:
                    value = rng.uniform(0.05, 0.1)
                    record.update({statistic: value, f"{statistic}_low": value * 0.9, f"{statistic}_high": value * 1.1})
                records.append(record)
    table = pd.DataFrame.from_records(records, columns=list(SERIES_COLUMNS))
    table["layer"] = table["layer"].astype("Int64")
    return table


@pytest.mark.parametrize("steps", [[1, 2, 3], [0, 500, 1000, 1500, 2000, 2500, 3000, 3500, 4000, 4500, 5000, 5500],
                                   [10, 100, 1000, 10000]], ids=["three steps", "twelve steps", "log scale"])
def test_the_step_axis_has_whole_number_ticks(steps):
    with style():
        figure = series_figure(series(steps, 2), ["self"], "title", by_layer=False).figure
        figure.canvas.draw()
    for ax in figure.axes:
        low, high = ax.get_xlim()
        ticks = [tick for tick in ax.get_xticks() if low <= tick <= high]
        assert ticks and all(float(tick).is_integer() for tick in ticks), ticks
        labels = [label.get_text() for label in ax.get_xticklabels() if label.get_text()]
        assert all(label.replace(",", "").lstrip("−-").isdigit() for label in labels), labels
        if len(steps) <= 10:
            assert sorted(ticks) == steps  # a tick at each checkpoint


@pytest.mark.parametrize("layers", [4, 12])
def test_the_layer_legend_covers_no_line(layers):
    with style():
        figure = series_figure(series([1, 2, 3, 4], layers, types=("encoder_self", "cross")), ["encoder_self", "cross"],
                               "title", by_layer=True).figure
        figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert len(legend.get_texts()) == layers
        for ax in figure.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), "the legend sits over a panel"
        figure_box = figure.bbox
        assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1 + 1  # and within the figure
