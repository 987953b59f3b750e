"""``probe show`` and ``Run.show``: one text at one site and head, its attention against the exact posterior p*.

The view's p* is checked against an independent solver (CVXPY on the primal, ``probe.solve.reference.cvxpy_primal``,
sharing no code with the run's Newton-CG) on the problem captured from the model, its attention against the model's
own eager attention from transformers, and its token labels against the run's stored tokens; on a tiny BERT
(two spaces, two alphas, padded batches), a tiny T5 (cross-attention: encoder tokens as keys) and the real
all-MiniLM-L6-v2 (slow).  The report's page shows the worst row's text, and the view is refused when the model
files changed since the run (a row of the bad-input table).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import probe
from probe.pipeline.recompute import batch_sites, load_job, row_problem
from probe.solve.reference import cvxpy_primal, templates_from_reduced
from probe.store.storage import read_manifest

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Short one.",
    "Attention is the closed-form solution of a convex problem, or so the claim goes.",
    "Why?",
    "Researchers measured the deviation for every layer, head and query token.",
]


@pytest.fixture(scope="module")
def tiny_run(tiny_bert_dir, tmp_path_factory):
    """A tiny BERT on texts of different lengths (padded batches of two), in both spaces at two alphas."""
    out = tmp_path_factory.mktemp("show")
    data = out / "texts.txt"
    data.write_text("\n".join(TEXTS) + "\n")
    return probe.run(tiny_bert_dir, dataset=data, batch_size=2, space="hidden,key", alpha="0.5,1",
                     out=out / "runs", progress=False)


def independent_posteriors(run_dir: Path, view) -> np.ndarray:
    """Each query's p* of the view's site and head, solved by CVXPY on the primal problem (P) (polished by Newton's
    method on it) from the problem captured again from the model: the rows of a (q, k) matrix over the real keys."""
    manifest = read_manifest(run_dir)
    job = load_job(run_dir, manifest)
    position = job.texts.indices.index(view.example)
    batch = next(b for b, positions in enumerate(job.batches) if position in positions)
    captured = batch_sites(job, batch, {(view.attention_type, view.layer)})
    row = captured.example_ids.index(view.example)
    site = captured.sites[(view.attention_type, view.layer)]
    keys = np.flatnonzero(site.key_mask[row].cpu().numpy())
    rows = []
    for query in view.query_positions:
        problem = row_problem(site, view.space, view.alpha, row, view.head, query)
        templates, evidence = templates_from_reduced(problem.gram, problem.logits, problem.evidence_sqnorm)  # T z1 = s
        _, p = cvxpy_primal(templates, evidence / view.alpha, problem.log_u, view.alpha)
        rows.append(p[keys])
    return np.array(rows)


def eager_attention(model_dir, text: str, layer: int, head: int, attention_type="self") -> np.ndarray:
    """The model's attention for the text alone, from transformers' own eager forward (no probe code)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        output = model(**tokenizer(text, return_tensors="pt"), output_attentions=True)
    return output.attentions[layer][0, head].double().numpy()


@pytest.mark.parametrize("space, alpha", [("hidden", 1.0), ("key", 0.5)])
def test_the_view_is_the_exact_posterior_of_the_models_attention(tiny_run, tiny_bert_dir, space, alpha):
    example, layer, head = 2, 1, 3  # the longest text, padded in no batch; in a batch with a shorter one
    view = tiny_run.show(example, layer, head, space=space, alpha=alpha)
    q, k = view.attention.shape
    assert (view.space, view.alpha, view.attention_type) == (space, alpha, "self") and q == k > 10
    np.testing.assert_allclose(view.posterior, independent_posteriors(tiny_run.run_dir, view), atol=1e-7, rtol=0)
    np.testing.assert_allclose(view.attention, eager_attention(tiny_bert_dir, TEXTS[example], layer, head), atol=1e-5)
    np.testing.assert_allclose(view.posterior.sum(1), 1, atol=1e-12)
    rows = tiny_run.select(example=example, layer=layer, head=head, space=space, alpha=alpha)
    assert view.query_tokens == view.key_tokens == rows.sort_values("query")["token"].tolist()  # the run's tokens
    assert view.query_positions == sorted(rows["query"])
    np.testing.assert_allclose(view.stored_rel_deviation, rows.sort_values("query")["rel_deviation"], rtol=1e-6)
    assert 0 <= view.largest_ratio <= 1  # recomputed within the certificates of the stored rows
    np.testing.assert_allclose(view.rel_deviation, view.stored_rel_deviation, atol=1e-8)


def test_a_view_is_a_png_or_a_pdf_and_a_notebook_shows_it(tiny_run, tmp_path):
    view = tiny_run.show(0, 0, 1, out=tmp_path / "figures" / "view.pdf")
    assert (tmp_path / "figures" / "view.pdf").read_bytes().startswith(b"%PDF")
    assert view.save(tmp_path / "view.png").read_bytes().startswith(b"\x89PNG")
    assert view._repr_png_().startswith(b"\x89PNG")
    figure = view.figure()
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles[:3] == ["the model's attention (λ = αz)", "exact posterior p* (λ = λ*)", "p* − attention"]
    main = figure.axes[0]
    assert [t.get_text() for t in main.get_yticklabels()] == view.query_tokens  # tokens as labels
    assert [t.get_text() for t in main.get_xticklabels()] == view.key_tokens
    figure.canvas.draw()
    every = [ax for parent in figure.axes for ax in (parent, *parent.child_axes)]  # the numbers: a secondary axis
    beside = [t.get_text() for ax in every for t in ax.get_yticklabels() if " ± " in t.get_text()]
    assert beside == [f"{r:.3g} ± {c:.0e}" for r, c in zip(view.rel_deviation, view.certificate)]


def test_a_long_text_labels_every_kth_token_with_its_position(tiny_run):
    """A view of thousands of tokens would print them on top of each other: at most MAX_LABELS labels a side, each
    with the token's position, and the numbers beside the same rows."""
    from dataclasses import replace

    from probe.report.text_view import MAX_LABELS

    view = tiny_run.show(0, 0, 1)
    q, k = 300, 1000
    long = replace(view, query_tokens=[f"q{i}" for i in range(q)], key_tokens=[f"k{i}" for i in range(k)],
                   query_positions=list(range(5, 5 + q)), attention=np.full((q, k), 1 / k),
                   posterior=np.full((q, k), 1 / k), rel_deviation=np.linspace(0, 1, q), error_bound=np.zeros(q),
                   lambda_norm=np.ones(q), stored_rel_deviation=np.full(q, np.nan), rebuilt=True)
    figure = long.figure()
    main = figure.axes[0]
    assert main.get_title() == "attention rebuilt from the logits (λ = αz; SDPA)"
    rows = [t.get_text() for t in main.get_yticklabels()]
    columns = [t.get_text() for t in main.get_xticklabels()]
    assert len(rows) <= MAX_LABELS and len(columns) <= MAX_LABELS
    assert rows[:2] == ["5 q0", "9 q4"] and columns[:2] == ["0 k0", "13 k13"]  # every 4th query, every 13th key
    figure.canvas.draw()
    every = [ax for parent in figure.axes for ax in (parent, *parent.child_axes)]
    beside = [t.get_text() for ax in every for t in ax.get_yticklabels() if " ± " in t.get_text()]
    assert len(beside) == len(rows) and beside[1] == f"{long.rel_deviation[4]:.3g} ± {long.certificate[4]:.0e}"


def test_probe_show_writes_the_view_and_says_what_it_checked(tiny_run):
    from typer.testing import CliRunner

    from probe.cli import app

    result = CliRunner().invoke(app, ["show", str(tiny_run.run_dir), "--example", "4", "--layer", "0", "--head",
                                      "2", "--space", "key"])
    assert result.exit_code == 0, result.output
    written = tiny_run.run_dir / "show" / "text-4-layer0-head2.png"
    assert written.read_bytes().startswith(b"\x89PNG")
    assert "stored row(s) agree within their certificates" in result.output and f"view: {written}" in result.output


def test_negative_indices_count_from_the_end_as_in_a_selection(tiny_run):
    """``--layer -1 --head -2`` on the tiny BERT (2 layers, 4 heads) is layer 1, head 2, as ``--layers -1`` and
    ``--heads -2`` select them in a run: the same view, named after the resolved site."""
    from typer.testing import CliRunner

    from probe.cli import app

    counted = tiny_run.show(3, -1, -2, space="key")
    direct = tiny_run.show(3, 1, 2, space="key")
    assert (counted.layer, counted.head) == (1, 2)
    np.testing.assert_array_equal(counted.rel_deviation, direct.rel_deviation)
    result = CliRunner().invoke(app, ["show", str(tiny_run.run_dir), "--example", "3", "--layer", "-1", "--head",
                                      "-2", "--space", "key"])
    assert result.exit_code == 0, result.output
    assert (tiny_run.run_dir / "show" / "text-3-layer1-head2.png").read_bytes().startswith(b"\x89PNG")


def test_a_negative_index_without_the_models_sizes_is_refused(tiny_run):
    """A manifest from before runs recorded their stacks' sizes: a negative index cannot be counted, and says so."""
    from probe.core.errors import ProbeError
    from probe.pipeline.recompute import resolve
    from probe.query import RunTable

    with RunTable.open(tiny_run.run_dir) as table:
        assert resolve(table, 3, 1, 2, None, "key", None, stacks=None).layer == 1
        with pytest.raises(ProbeError, match="does not record how many layers the model's self stack has, so count "
                                             "from 0"):
            resolve(table, 3, -1, 2, None, "key", None, stacks=None)


@pytest.mark.slow
def test_the_report_shows_the_worst_rows_text(tiny_run, tmp_path):
    out = tiny_run.report(tmp_path / "report", progress=False)
    page = (out / "index.html").read_text(encoding="utf-8")
    rows = tiny_run.rows
    main = rows[(rows["space"] == "hidden") & (rows["alpha"] == 1.0) & ~rows["trivial"]]
    worst = main.sort_values(["rel_deviation", "example", "query"], ascending=[False, True, True]).iloc[0]
    stem = f"text_{worst['example']}_self_layer{worst['layer']}_head{worst['head']}"
    assert 'id="worst-text"' in page and f'<figure id="{stem}"' in page and (out / f"{stem}.png").exists()
    assert f"query {worst['query']} ({worst['token']}), {worst['rel_deviation']:.3g}" in page


@pytest.mark.slow
def test_a_report_whose_model_is_gone_says_why_it_has_no_text_view(tiny_bert_dir, tmp_path):
    import shutil

    model = Path(shutil.copytree(tiny_bert_dir, tmp_path / "model"))
    run = probe.run(model, texts=TEXTS[:2], out=tmp_path / "runs", progress=False)
    (model / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()), "x": 1}))
    page = (run.report(tmp_path / "report", progress=False) / "index.html").read_text(encoding="utf-8")
    assert 'id="worst-text"' in page and "No text view: The model files of" in page and "changed" in page


def test_cross_attention_has_the_encoders_tokens_as_keys(tmp_path, minilm_dir):
    """On a tiny T5: a cross-attention view's queries are the decoder's tokens and its keys the encoder's, as the
    run's own rows name them (decoder_self and encoder_self queries)."""
    from ..support.families import SOURCES, TARGETS, save_tiny, spec

    model = save_tiny(spec("t5"), tmp_path / "t5", minilm_dir)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"text": s, "target": t}) + "\n" for s, t in zip(SOURCES, TARGETS)))
    run = probe.run(model, dataset=data, target_column="target", batch_size=2, out=tmp_path / "runs", progress=False)
    view = run.show(1, 1, 2, attention_type="cross")
    tokens = {kind: run.select(example=1, layer=0, head=0, attention_type=kind).sort_values("query")["token"].tolist()
              for kind in ("encoder_self", "decoder_self")}
    assert view.query_tokens == tokens["decoder_self"] and view.key_tokens == tokens["encoder_self"]
    np.testing.assert_allclose(view.posterior, independent_posteriors(run.run_dir, view), atol=1e-7, rtol=0)


@pytest.mark.slow
def test_the_view_on_the_real_minilm(minilm_dir, tmp_path):
    run = probe.run(minilm_dir, samples=8, max_length=32, out=tmp_path / "runs", progress=False)
    view = run.show(5, 3, 7)
    np.testing.assert_allclose(view.posterior, independent_posteriors(run.run_dir, view), atol=1e-7, rtol=0)
    from probe.capture.data import embedded_corpus

    np.testing.assert_allclose(view.attention, eager_attention(minilm_dir, embedded_corpus()[5], 3, 7), atol=1e-5)
    assert view.largest_ratio <= 1 and view.query_tokens[0] == "[CLS]" and view.query_tokens[-1] == "[SEP]"
