"""Fuzzed inputs (Hypothesis): the data readers, every option parser and the solver on generated hard
instances.  Each data file either loads (non-empty texts) or gives the one-paragraph ProbeError; each
option value either passes the option checks or exits with status 2 and a message, never a traceback;
every solved row is either certified or flagged as not converged.  Example counts are kept small so
that the file runs in well under a minute."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli import app
from probe.capture.data import DatasetSpec, load_texts
from probe.core.errors import ProbeError
from probe.solve.dual import DualProblems, solve_dual

FAST = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------- data readers


def assert_loads_or_explains(path, column=None, samples=None):
    try:
        texts = load_texts(DatasetSpec(name=str(path), column=column, samples=samples))
    except ProbeError as error:
        message = str(error)
        assert message and "Traceback" not in message and "\n\n" not in message, message
        return None
    assert texts.texts and all(isinstance(t, str) and t.strip() for t in texts.texts)
    assert len(texts.indices) == len(texts.texts) and texts.indices == sorted(set(texts.indices))
    if samples is not None:
        assert len(texts.texts) <= samples
    return texts


SUFFIXES = [".txt", ".csv", ".jsonl", ".json", ".parquet"]


@FAST
@given(data=st.binary(max_size=300), suffix=st.sampled_from(SUFFIXES))
def test_random_bytes(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("bytes") / f"data{suffix}"
    path.write_bytes(data)
    assert_loads_or_explains(path)


@FAST
@given(lines=st.lists(st.text(max_size=40), max_size=8), suffix=st.sampled_from([".txt", ".csv", ".jsonl"]),
       newline=st.sampled_from(["\n", "\r\n", "\r"]), long=st.integers(0, 200_000),
       samples=st.none() | st.integers(1, 3))
def test_unicode_and_long_lines(tmp_path_factory, lines, suffix, newline, long, samples):
    """Any unicode (surrogates excepted: not encodable), a line of up to 200,000 characters."""
    lines = [line.encode("utf-8", "replace").decode("utf-8") for line in lines] + ["x" * long]
    path = tmp_path_factory.mktemp("text") / f"data{suffix}"
    path.write_text(newline.join(lines), encoding="utf-8", errors="replace")
    loaded = assert_loads_or_explains(path, samples=samples)
    if loaded is not None and suffix == ".txt" and long:
        assert samples is not None or "x" * long in loaded.texts


csv_field = st.text(alphabet=st.sampled_from('ab ,"\n\'\t;é'), max_size=10)


@FAST
@given(header=st.lists(csv_field, min_size=1, max_size=3), rows=st.lists(st.lists(csv_field, max_size=4), max_size=5),
       quote=st.booleans(), column=st.sampled_from([None, "text", "a", '"', ""]))
def test_csv_quoting(tmp_path_factory, header, rows, quote, column):
    def field(value):
        return '"' + value.replace('"', '""') + '"' if quote else value

    path = tmp_path_factory.mktemp("csv") / "data.csv"
    path.write_text("\n".join(",".join(map(field, row)) for row in [header, *rows]) + "\n", encoding="utf-8")
    assert_loads_or_explains(path, column=column or None)


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6,
)


@FAST
@given(records=st.lists(st.one_of(st.dictionaries(st.sampled_from(["text", "label", "other"]), json_value,
                                                  max_size=3), json_value), max_size=6),
       blank_lines=st.booleans(), column=st.sampled_from([None, "label"]))
def test_jsonl_shapes(tmp_path_factory, records, blank_lines, column):
    """Objects with and without the column, of any value type, and lines that are not objects at all."""
    path = tmp_path_factory.mktemp("jsonl") / "data.jsonl"
    path.write_text(("\n\n" if blank_lines else "\n").join(json.dumps(r) for r in records), encoding="utf-8")
    assert_loads_or_explains(path, column=column)


@pytest.mark.parametrize("content", ["null", "\n  null \n{\"text\": \"a\"}\n", "null\nnull\n"])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_json_null_first_is_refused_not_a_crash(tmp_path, content, suffix):
    """Found by test_jsonl_shapes: pyarrow's JSON reader (which datasets calls first) dies with a
    segmentation fault on a file whose first value is null; probe refuses it before."""
    path = tmp_path / f"data{suffix}"
    path.write_text(content)
    with pytest.raises(ProbeError, match=r"line \d is a JSON null, not an object"):
        load_texts(DatasetSpec(name=str(path)))


def test_empty_and_large_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert assert_loads_or_explains(empty) is None  # an empty file is refused with a message
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n\n")
    assert assert_loads_or_explains(blank) is None
    large = tmp_path / "large.txt"  # 200,000 lines, 9 MB
    large.write_text("".join(f"line {i} of a large file, with some words in it\n" for i in range(200_000)))
    loaded = assert_loads_or_explains(large, samples=5)
    assert loaded.texts == [f"line {i} of a large file, with some words in it" for i in range(5)]


# ----------------------------------------------------------------------------------------- option parsers


@pytest.fixture
def options_only(monkeypatch):
    """`probe run` up to its option checks: the pipeline is replaced by them, then a refusal, so that no
    model is loaded and nothing is written."""
    import probe.pipeline.runner
    from probe.pipeline.validate import check_options

    def checks_only(config):
        check_options(config)
        raise ProbeError("options accepted")

    monkeypatch.setattr(probe.pipeline.runner, "run", checks_only)


def assert_clean_exit(result):
    """Exit 2 with a message (ours and click's alike: 'Error: ...'), never a traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert "Error: " in result.output, result.output


option_text = st.one_of(
    st.text(max_size=20),
    st.floats().map(repr),
    st.from_regex(r"\A-?[0-9.e+-]{0,8}(,[0-9.e+-]{0,6}){0,3}\Z"),
    st.from_regex(r"\A[0-9]{0,400}(\.[0-9]*)?\s*([kKmMgGtT]i?[bB])?\Z"),
    st.sampled_from(["cuda:abc", "cuda:-1", "meta", "cpu:1", "mps", "inf", "nan", "-0", "1e400", "0x10",
                     "hidden,,key", "hidden,hidden", " ", ",", "png,,pdf", "svg"]),
)
RUN_OPTIONS = ["--alpha", "--space", "--max-memory", "--device", "--dtype", "--init", "--batch-size", "--max-length",
               "--samples", "--threads", "--fidelity-tolerance", "--seed", "--format"]


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(RUN_OPTIONS), value=option_text)
def test_run_options(options_only, tmp_path, option, value):
    extra = ["--report"] if option == "--format" else []
    result = CliRunner().invoke(app, ["run", "some-model", "--out", str(tmp_path), option, value, *extra])
    assert_clean_exit(result)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from([["verify", "--sample"], ["verify", "--seed"], ["report", "--format"],
                                ["export", "--to"], ["compare", "--name"]]), value=option_text)
def test_other_commands_options(tmp_path, command, value):
    """The other commands on a directory that is not a run: a usage error or the one-paragraph refusal."""
    name, option = command
    runs = [str(tmp_path / "a"), str(tmp_path / "b")] if name == "compare" else [str(tmp_path / "nowhere")]
    result = CliRunner().invoke(app, [name, *runs, option, value])
    assert_clean_exit(result)


# ----------------------------------------------------------------------------------------------- solver


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 10), d=st.integers(1, 8), m=st.integers(1, 6),
       template_scale=st.sampled_from([0.0, 1e-8, 1e-3, 1.0, 30.0, 300.0]),
       evidence_scale=st.sampled_from([0.0, 1e-8, 1.0, 100.0, 1e4]),
       alpha=st.sampled_from([1e-3, 1.0, 1e3]), excluded=st.integers(0, 9), duplicate=st.booleans(),
       inactive=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_every_row_is_certified_or_flagged(n, d, m, template_scale, evidence_scale, alpha, excluded, duplicate,
                                           inactive, seed):
    """Groups of m rows sharing templates: zero, tiny and huge templates and evidence (logits up to
    ~1e7), duplicated templates, excluded keys, inactive rows.  Every active row either meets its
    certificate (converged, finite, error_bound <= rtol ||lambda||) and then lies within it of the
    reference optimum, or is flagged (converged False); inactive rows are never counted as converged."""
    from probe.solve.reference import lbfgs_dual

    rng = np.random.default_rng(seed)
    T = rng.normal(size=(n, d)) * template_scale
    if duplicate and n > 1:
        T[-1] = T[0]
    Z = rng.normal(size=(m, d)) * evidence_scale
    log_u = np.tile(rng.normal(size=n), (m, 1))
    log_u[:, rng.permutation(n)[: min(excluded, n - 1)]] = -np.inf
    active = np.ones(m, bool)
    active[: min(inactive, m - 1)] = False
    t = torch.as_tensor(T)
    z = torch.as_tensor(Z)
    rtol, atol = 1e-9, 1e-12
    solution = solve_dual(DualProblems(gram=(t @ t.T)[None], logits=(z @ t.T)[None],
                                       log_preference=torch.as_tensor(log_u)[None],
                                       evidence_sqnorm=(z * z).sum(-1)[None], alpha=alpha,
                                       active=torch.as_tensor(active)[None]), rtol=rtol, atol=atol)
    converged = solution.converged[0].numpy()
    assert not converged[~active].any() or np.all(np.isfinite(solution.lambda_norm[0].numpy()[~active]))
    for row in np.flatnonzero(active & converged):
        lam_norm, bound = float(solution.lambda_norm[0, row]), float(solution.error_bound[0, row])
        rel = float(solution.rel_deviation[0, row])
        assert math.isfinite(lam_norm) and math.isfinite(bound), (row, lam_norm, bound)
        assert math.isfinite(rel) or (lam_norm == 0 and rel == math.inf), (row, lam_norm, rel)  # never NaN
        if np.linalg.norm(Z[row]) == 0 and template_scale == 0:  # lambda* = alpha z = 0: no deviation
            assert rel == 0.0
        assert bound <= rtol * lam_norm + atol, (bound, lam_norm)  # the solver's criterion (probe.solve.dual)
        lam = alpha * Z[row] + solution.coefficients[0, row].numpy() @ T
        lam_ref, _ = lbfgs_dual(T, Z[row], log_u[row], alpha)
        keep = np.isfinite(log_u[row])
        u = np.exp(log_u[row][keep] - np.logaddexp.reduce(log_u[row][keep]))
        theta = log_u[row][keep] + T[keep] @ lam_ref
        p = np.exp(theta - np.logaddexp.reduce(theta))
        reference_error = alpha * np.linalg.norm(T[keep].T @ u + Z[row] - lam_ref / alpha - T[keep].T @ p)
        assert np.linalg.norm(lam - lam_ref) <= bound + reference_error + 1e-9 * max(1.0, np.linalg.norm(lam_ref))
