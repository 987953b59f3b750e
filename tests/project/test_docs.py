"""The documentation site teaches: its math renders, its references resolve, its CLI reference is a
table per command, and its tutorial's numbers are the committed reports' numbers.

Most checks read one strict build of the site (``mkdocs build --strict``, 20 to 40 s on this 2-core
machine: slow); under .ci/run they read the build CI has just made.  The docstring rewriting
(docs/hooks/docstrings.py) and the tutorial's numbers are checked without a build.
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HAS_DOCS_EXTRA = subprocess.run([sys.executable, "-c", "import mkdocs, material, mkdocstrings, pymdownx"],
                                capture_output=True).returncode == 0
needs_docs = pytest.mark.skipif(not HAS_DOCS_EXTRA, reason='needs the docs extra: pip install -e ".[docs]"')

#: a reST role as it shows when nothing rewrote it: ":class:`X`" in Markdown, ":class:<code>X</code>" in HTML
RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|math):(?:`|<code>)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site: .ci/run's strict build (``$PROBE_DOCS_SITE``), or one built here."""
    if not HAS_DOCS_EXTRA:
        pytest.skip('needs the docs extra: pip install -e ".[docs]"')
    built = os.environ.get("PROBE_DOCS_SITE")
    if built and (Path(built) / "index.html").exists():
        return Path(built)
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def pages(site: Path) -> dict[str, str]:
    return {str(path.relative_to(site)): path.read_text() for path in sorted(site.rglob("*.html"))
            if "assets" not in path.parts}


def visible_text(page_html: str) -> str:
    """A page's article as a reader sees it before KaTeX runs, without code and without the math."""
    article = page_html.split('<article', 1)[-1].split("</article>", 1)[0]
    for tag in ("pre", "code", "script", "style"):
        article = re.sub(rf"<{tag}\b.*?</{tag}>", " ", article, flags=re.S)
    article = re.sub(r'<(span|div) class="arithmatex">.*?</\1>', " ", article, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", article))


def math_expressions(page_html: str) -> list[tuple[str, bool]]:
    """Every expression arithmatex left for KaTeX: ``(tex, displayed)``."""
    found = []
    for _tag, body in re.findall(r'<(span|div) class="arithmatex">(.*?)</\1>', page_html, flags=re.S):
        tex = html.unescape(body).strip()
        found.append((re.sub(r"^\\[(\[]|\\[)\]]$", "", tex).strip(), tex.startswith("\\[")))
    return found


# --------------------------------------------------------------------------------------------------
# the built site


@pytest.mark.slow
def test_no_page_shows_a_raw_rest_role_or_unrendered_markup(site):
    """Roles, ``.. math::`` and ``$...$`` are rewritten everywhere, the API reference included: no dollar
    and no LaTeX command is left in a page's text outside code and math."""
    problems = []
    for name, text in pages(site).items():
        if RAW_ROLE.search(text) or ".. math::" in text:
            problems.append(f"{name}: a raw reST role or directive")
        visible = visible_text(text)
        leak = re.search(r"\$|\\(frac|lambda|alpha|mathrm|tfrac|sum|\|)", visible)
        if leak:
            problems.append(f"{name}: LaTeX outside math: {visible[max(0, leak.start() - 80):leak.end() + 80]!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_math_is_rendered_on_the_math_ot_and_api_pages(site):
    for name, least in (("math", 30), ("ot", 100), ("api-solvers", 200), ("tutorial", 5)):
        expressions = math_expressions(page(site, name))
        assert len(expressions) >= least, (name, len(expressions))
        assert any(displayed for _, displayed in expressions), name
    # the pages load the KaTeX shipped with the site, not a CDN's
    text = page(site, "math")
    assert 'src="../assets/katex/katex.min.js"' in text and "assets/katex-render.js" in text
    assert "cdn" not in " ".join(re.findall(r'<script[^>]+src="([^"]+)"', text)).lower()
    assert (site / "assets" / "katex" / "fonts" / "KaTeX_Main-Regular.woff2").exists()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the shipped KaTeX")
def test_every_math_expression_renders_with_the_shipped_katex(site):
    """Each expression of every page goes through the site's own katex.min.js with throwOnError: a
    command KaTeX does not know would otherwise show as red source text in the reader's browser."""
    expressions = sorted({item for text in pages(site).values() for item in math_expressions(text)})
    assert len(expressions) > 300
    script = """
const katex = require(process.argv[1]);
const items = JSON.parse(require("fs").readFileSync(0, "utf8"));
const errors = [];
for (const [tex, display] of items) {
  try { katex.renderToString(tex, {displayMode: display, throwOnError: true}); }
  catch (e) { errors.push(tex + "  ->  " + e.message); }
}
console.log(JSON.stringify(errors));
"""
    katex = site / "assets" / "katex" / "katex.min.js"
    done = subprocess.run(["node", "-e", script, str(katex)], input=json.dumps(expressions),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == []


@pytest.mark.slow
def test_cross_references_are_links_and_examples_are_code(site):
    api = page(site, "api")
    for target in ("probe.core.errors.ProbeError", "probe.pipeline.stopping.RunStopped", "probe.api.resume",
                   "probe.core.schema.ROW_KEY", "probe.store.integrity.require_intact", "probe.report.build_report"):
        assert re.search(rf'<a class="autorefs autorefs-internal"[^>]*href="[^"]*#{re.escape(target)}"', api), target
    assert 'id="probe.api.run"' in api and 'id="probe.api.Run.rows"' in api
    # the module's >>> example is a highlighted code block, not a run-together block quote
    blocks = re.findall(r'<div class="[^"]*highlight">\s*<pre>.*?</pre>', api, re.S)
    example = [block for block in blocks if '<span class="gp">&gt;&gt;&gt; </span>' in block]  # pycon prompts
    assert example and "probe.run()" in html.unescape(re.sub(r"<[^>]+>", "", example[0]))
    assert "<blockquote>" not in api.split('id="probe.api"', 1)[1].split('id="probe.api.DEMO_PACKAGE"', 1)[0]
    # a math role inside a docstring is math on the solvers page
    assert len(math_expressions(page(site, "api-solvers"))) > 200


@pytest.mark.slow
def test_the_cli_reference_has_a_table_per_command(site):
    import typer

    from probe.cli import app

    cli = page(site, "cli")
    group = typer.main.get_command(app)
    context = group.context_class(group, info_name="probe")
    run = group.get_command(context, "run")
    for name in group.list_commands(context):
        assert f'id="probe-{name}"' in cli, name
    section = cli.split('id="probe-run"', 1)[1].split('id="probe-resume"', 1)[0]
    rows = re.findall(r"<tr>.*?</tr>", section, re.S)
    for param in run.params:
        if param.param_type_name == "option":
            row = next((r for r in rows if f"<code>{param.opts[0]}</code>" in r), None)
            assert row is not None, param.opts[0]
            if param.help:
                assert param.help.split()[0] in html.unescape(re.sub(r"<[^>]+>", "", row)), param.opts[0]
    assert "<th>Type</th>" in section and "<th>Default</th>" in section
    assert "Usage:" not in cli  # no raw --help text


@pytest.mark.slow
def test_the_tutorial_shows_the_committed_figures(site):
    tutorial = page(site, "tutorial")
    for figure in re.findall(r'<img[^>]+src="([^"]+)"', tutorial):
        assert (site / "tutorial" / figure).resolve().exists(), figure
    assert "reports/all-MiniLM-L6-v2/overview.png" in tutorial


# --------------------------------------------------------------------------------------------------
# no build: the docstring rewriting and the tutorial's numbers


def hooks():
    """docs/hooks/docstrings.py, a griffe extension: it needs griffe (the docs extra, which the test extra holds)."""
    pytest.importorskip("griffe", reason='needs the docs extra: pip install -e ".[docs]"')
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import docstrings
    finally:
        sys.path.pop(0)
    return docstrings


@pytest.fixture(scope="module")
def probe_package():
    griffe = pytest.importorskip("griffe")
    return griffe.load("probe", search_paths=[str(ROOT)])


def test_rest_blocks_become_markdown():
    blocks = hooks().blocks
    text = "Intro::\n\n    a = 1\n    b = 2\n\nThen\n\n>>> import probe\n>>> probe.run()\n\n.. math::  a = b\n           + c\n\nEnd."
    pieces = blocks(text)
    joined = "\n".join(piece for _, piece in pieces)
    assert "Intro:\n" in joined and "Intro::" not in joined
    assert "```python\na = 1\nb = 2\n```" in joined
    assert "```pycon\n>>> import probe\n>>> probe.run()\n```" in joined
    assert "$$\na = b\n+ c\n$$" in joined
    assert [code for code, _ in pieces] == [False, True, False, True, False, True, False]


def test_roles_become_math_and_links(probe_package, caplog):
    docstrings = hooks()
    api = probe_package["api"]
    run = probe_package["api.Run"]
    inline = docstrings.inline
    assert inline(api, ":math:`\\lambda^*\n  = \\alpha z`") == r"$\lambda^* = \alpha z$"  # one line
    assert inline(api, ":func:`resume`") == "[`resume`][probe.api.resume]"
    assert inline(run, ":attr:`Run.interventions`") == "[`Run.interventions`][probe.api.Run.interventions]"
    assert inline(api, ":class:`~probe.pipeline.stopping.RunStopped`") == "[`RunStopped`][probe.pipeline.stopping.RunStopped]"
    # a name the package exports lazily resolves to where it is defined
    assert inline(api, ":class:`probe.ProbeError`") == "[`probe.ProbeError`][probe.core.errors.ProbeError]"
    assert inline(api, ":class:`ValueError`") == "`ValueError`"  # a builtin: code, no link
    assert inline(api, ":class:`pyarrow.Table`") == "`pyarrow.Table`"  # another package's name
    with caplog.at_level(logging.WARNING):
        assert inline(api, ":func:`probe.api.no_such_function`") == "`probe.api.no_such_function`"
    assert "names no object" in caplog.text  # a warning: the strict build fails on it


def test_the_tutorial_numbers_are_the_committed_reports():
    """Every number the tutorial quotes, recomputed from reports/ (a regenerated report that is not
    carried into the text fails here)."""
    import pandas as pd

    tutorial = " ".join((DOCS / "tutorial.md").read_text().split())
    report = ROOT / "reports" / "all-MiniLM-L6-v2"
    manifest = json.loads((report / "manifest.json").read_text())
    summary = json.loads((report / "summary.json").read_text())
    solver, fidelity = manifest["solver"], manifest["fidelity"]
    headline = summary["headline"][0]
    assert solver["converged"] == solver["rows"] == headline["rows"] and fidelity["passed"]
    expected = [
        f"This run has {solver['rows']:,} rows",
        f"The largest certified error bound is {solver['max_relative_error_bound']:.1e}",
        f"matched the model's attention to {fidelity['max_abs_error']:.1e}, within the tolerance of "
        f"{fidelity['tolerance']:.0e}",
        f"the mean is {headline['mean']:.3f} and the 95th percentile is {headline['p95']:.3f}",
        f"The maximum is {headline['max']:.3f}. {headline['share_above_0.1']:.1%} of the rows are above 0.1",
        f"{summary['dataset'].split(', ')[-1].split()[0]} English sentences",
        f"A mean of {headline['mean']:.3f} says the exact $\\lambda^*$ lies {headline['mean']:.1%} of its length away",
    ]
    (cls,) = [f for f in summary["findings"] if f["kind"] == "query_position"]  # the [CLS] finding, merged
    assert cls["value"] == 0 and {d["name"] for d in cls["same_rows"]} == {"query token '[CLS]'", "token role 'special'"}
    expected.append(f"Its mean is {cls['mean']:.3f} against {cls['rest_mean']:.3f} for the rest ({cls['ratio']:.2f}x)")
    from probe.report.findings import MIN_RATIO

    assert f"{MIN_RATIO:g}x the rest's" in summary["findings_rule"]
    assert f"the group's mean is at least {MIN_RATIO:g} times the rest's" in tutorial
    layers = pd.read_csv(report / "summary.csv")
    layers = layers[(layers["level"] == "layer") & (layers["space"] == "hidden") & (layers["alpha"] == 1.0)]
    means = layers.set_index("layer")["mean"]
    expected.append(f"The mean grows from {means.iloc[0]:.3f} in layer 0 to {means.iloc[-1]:.3f} in layer 5")
    expected.append("| mean `rel_deviation` | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    assert len(means) == 6
    quantities = pd.DataFrame(summary["quantities"]).set_index(["quantity", "layer"])["mean"]
    for name in ("attention_tv", "output_deviation"):
        per_layer = quantities.loc[name]
        low, high = per_layer.idxmin(), per_layer.idxmax()
        expected.append(f"runs from {per_layer[low]:.3f} in layer {low} to {per_layer[high]:.3f} in layer {high}")
        if name == "attention_tv":
            expected.append(f"moves {per_layer[low]:.0%} to {per_layer[high]:.0%} of the attention mass")
    compare = pd.read_csv(ROOT / "reports" / "all-MiniLM-L6-v2-vs-random" / "compare.csv").set_index("run")
    for run, label in (("pretrained", "pretrained"), ("random-init", "random init")):
        r = compare.loc[run]
        expected.append(f"| {label} | {r['rows']:,} | {r['mean']:.3f} | {r['share_above_0.1']:.1%} |")
    pretrained, random = compare.loc["pretrained"], compare.loc["random-init"]
    expected.append(f"training puts {pretrained['share_above_0.1']:.1%} of the rows above 0.1, against "
                    f"{random['share_above_0.1']:.1%} at random init")
    missing = [sentence for sentence in expected if sentence not in tutorial]
    assert not missing, missing


def test_the_ot_page_quotes_the_committed_model_measurement():
    import pandas as pd

    from ..support.committed_results import ot_quality_sentence

    text = " ".join((DOCS / "ot.md").read_text().split())
    assert ot_quality_sentence() in text
    meta = json.loads((ROOT / "reports" / "ot" / "quality_model.json").read_text())["meta"]
    grid = pd.read_csv(ROOT / "reports" / "ot" / "quality_model.csv")
    at_gamma = grid[(grid["gamma"] - meta["model_gamma"]).abs() < 1e-9].set_index("alpha")
    assert (at_gamma["certified_fraction"] == 1.0).all()
    median = at_gamma["rel_deviation_median"]
    assert (f"the median deviation is {median[2.0]:.3f} at $\\alpha = 2$ and {median[8.0]:.3f} at "
            f"$\\alpha = 8$") in text


def test_the_home_page_does_not_send_the_reader_to_the_readme():
    index = (DOCS / "index.md").read_text()
    assert "README" not in index and "(tutorial.md)" in index
    nav = (ROOT / "mkdocs.yml").read_text()
    assert "tutorial.md" in nav
