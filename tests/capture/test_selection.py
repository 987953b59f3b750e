"""Choosing what a run measures: ``--layers``, ``--heads``, ``--attention-types`` and ``--queries``.

* The grammar (:mod:`probe.core.arguments`) and the resolution against a model's stacks
  (:mod:`probe.capture.selection`), with the model's range in every refusal.
* ``sample:N`` keeps exactly ``min(N, tokens)`` positions per text, reproducible from the seed.
* A selective run's rows are the same rows of a full run of the same texts (within their certificates), on a
  rotary grouped-query decoder (Llama), an encoder (BERT) and an encoder-decoder (T5); the positions kept are
  checked against the rule computed here from the tokenizer (``every:K``, ``last``), and ``sample:N``'s are the
  same at every site and head and do not depend on the batch size.
* Every family's stacks, read from its config before the model loads (:meth:`Adapter.stacks`), are the
  sites and heads its capture emits.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import probe
from probe.batch import rows as rows_module
from probe.capture.selection import Selection, Stack, query_positions, resolve, sampled_positions
from probe.core.arguments import IndexRange, QueryRule, indices, queries
from probe.core.config import RunConfig
from probe.core.errors import ProbeError
from probe.solve import derived, second_order

from ..support.families import ALL, CORPUS, SOURCES, TARGETS, save_tiny, spec

KEY = ["space", "alpha", "attention_type", "layer", "head", "example", "query"]

# --------------------------------------------------------------------------------------------------
# the grammar


@pytest.mark.parametrize("given, expected", [
    ("0", [(0, 0)]), ("0,5,-1", [(0, 0), (5, 5), (-1, -1)]), ("2-4", [(2, 4)]), (" 1 , 3-5 ", [(1, 1), (3, 5)]),
    ("-4--1", [(-4, -1)]), (3, [(3, 3)]), ([0, -1], [(0, 0), (-1, -1)]), (None, None),
])
def test_indices_grammar(given, expected):
    found = indices(given, "layers")
    assert (None if found is None else [(r.first, r.last) for r in found]) == expected


@pytest.mark.parametrize("given", ["", "a", "1;2", "1-", "-", "1.5", [1.5], [True], [], {"a": 1}, "3-1", "-1--2"])
def test_indices_refusals(given):
    with pytest.raises(ProbeError):
        indices(given, "layers")


@pytest.mark.parametrize("given, expected", [
    ("all", QueryRule()), ("last", QueryRule("last")), ("every:4", QueryRule("every", 4)),
    ("sample:32", QueryRule("sample", 32)), (" Sample : 7 ", QueryRule("sample", 7)),
])
def test_query_grammar(given, expected):
    assert queries(given) == expected
    assert queries(str(expected)) == expected  # as the manifest records it


@pytest.mark.parametrize("given", ["first", "every", "every:0", "sample:-1", "sample:x", "last:2", "all:1", 3,
                                   "every:2,last"])
def test_query_refusals(given):
    with pytest.raises(ProbeError):
        queries(given)


def test_index_ranges_resolve_from_the_end():
    assert list(IndexRange(-1, -1).resolve(12)) == [11]
    assert list(IndexRange(-4, -1).resolve(12)) == [8, 9, 10, 11]
    assert list(IndexRange(2, 4).resolve(12)) == [2, 3, 4]
    assert IndexRange(12, 12).resolve(12) is None and IndexRange(-13, -13).resolve(12) is None
    assert IndexRange(4, 2).resolve(12) is None


# --------------------------------------------------------------------------------------------------
# resolution against the model's stacks

T5_STACKS = {"encoder_self": Stack(2, 4), "decoder_self": Stack(3, 4), "cross": Stack(3, 4)}


def settings(**options) -> RunConfig:
    return RunConfig.from_options("model", **options)


def _manifest(stacks: dict, seed: int = 0, **options) -> dict:
    """A manifest's ``config`` and ``selection`` as a run of ``options`` on a model of ``stacks`` records them."""
    config = settings(seed=seed, **options)
    chosen = resolve(config, {kind: Stack(*sizes) for kind, sizes in stacks.items()})
    return {"config": {name: getattr(config, name) for name in ("layers", "heads", "attention_types", "queries", "seed")},
            "selection": chosen.record()}


SIX, TWELVE = {"self": (6, 12)}, {"self": (12, 12)}


@pytest.mark.parametrize("first, second, differ", [
    (_manifest(SIX), _manifest(TWELVE), False),  # every row of models of two sizes
    (_manifest(SIX, layers="0-5"), _manifest(SIX), False),  # the same rows, spelled two ways
    (_manifest(SIX, layers="-1"), _manifest(SIX, layers="0"), True),
    (_manifest(SIX, heads="0"), _manifest(SIX), True),
    (_manifest(SIX, queries="last"), _manifest(SIX), True),
    (_manifest(SIX, queries="sample:4", seed=0), _manifest(SIX, queries="sample:4", seed=1), True),
    (_manifest(SIX, queries="every:4", seed=0), _manifest(SIX, queries="every:4", seed=1), False),  # no draw
    (_manifest(SIX, heads="0"), {"config": {}}, False),  # a run from before selections: not compared
])
def test_compare_says_when_runs_measured_different_rows(first, second, differ):
    from probe.capture.selection import selection_differences

    found = selection_differences({"runs/a": first, "runs/b": second})
    assert (found is not None) == differ
    if differ:
        assert found.startswith("The runs did not measure the same rows (their selections differ): runs/a: ")
        assert f"runs/b: {second['selection']['description']}" in found


def test_layers_count_within_each_attention_types_stack():
    chosen = resolve(settings(layers="-1"), T5_STACKS)
    assert chosen.layers == {"encoder_self": (1,), "decoder_self": (2,), "cross": (2,)}
    assert chosen.heads == {kind: (0, 1, 2, 3) for kind in T5_STACKS}
    chosen = resolve(settings(layers="0", attention_types="cross", heads="1,-1"), T5_STACKS)
    assert chosen.layers == {"cross": (0,)} and chosen.heads == {"cross": (1, 3)}
    assert chosen.describe() == "attention types cross; layers 0; heads 1, 3"
    assert not chosen.everything and resolve(settings(), T5_STACKS).everything


def test_out_of_range_gives_the_models_range():
    with pytest.raises(ProbeError, match=r"2 is out of range for this model \(encoder_self: 2 layers, 0 to 1 \(or -2 "
                                         r"to -1\); decoder_self: 3 layers"):
        resolve(settings(layers="2"), T5_STACKS)
    assert resolve(settings(layers="2", attention_types="decoder_self,cross"), T5_STACKS).layers == {
        "decoder_self": (2,), "cross": (2,)}
    with pytest.raises(ProbeError, match="no such attention type; its types are encoder_self, decoder_self, cross"):
        resolve(settings(attention_types="self"), T5_STACKS)


# --------------------------------------------------------------------------------------------------
# sampled positions


@pytest.mark.parametrize("count", [1, 5, 32])
def test_sample_keeps_min_n_tokens_distinct_positions(count):
    for size in range(0, 70):
        picked = sampled_positions(count, size, seed=3, example=size * 7, sequence=0)
        assert len(picked) == min(count, size) == len(set(picked.tolist()))
        assert np.all(np.diff(picked) > 0) and (len(picked) == 0 or (picked.min() >= 0 and picked.max() < size))
        again = sampled_positions(count, size, seed=3, example=size * 7, sequence=0)
        assert np.array_equal(picked, again)


def test_sample_depends_on_seed_text_and_sequence():
    draws = {(seed, example, sequence): tuple(sampled_positions(8, 200, seed, example, sequence))
             for seed in (0, 1) for example in (0, 1, 2) for sequence in (0, 1)}
    assert len(set(draws.values())) == len(draws)


def test_the_rules_on_one_sequence():
    assert query_positions(QueryRule("last"), 9, 0, 0, 0).tolist() == [8]
    assert query_positions(QueryRule("every", 4), 9, 0, 0, 0).tolist() == [0, 4, 8]
    assert query_positions(QueryRule(), 3, 0, 0, 0).tolist() == [0, 1, 2]


# --------------------------------------------------------------------------------------------------
# selective runs against a full run


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_dir):
    """Tiny random Llama (4 query heads on 2 key-value heads, rotary, padded left), BERT and T5, saved."""
    made = {}
    for name in ("llama", "bert", "t5"):
        directory = tmp_path_factory.mktemp(f"select-{name}")
        family = spec(name)
        save_tiny(family, directory, minilm_dir, padding_side="left" if family.kind == "decoder" else None)
        made[name] = (family, directory)
    return made


def _texts(family):
    return list(SOURCES if family.kind == "encoder_decoder" else CORPUS)


def _run(models, name, tmp_path_factory, **options):
    family, directory = models[name]
    extra = {"dataset": None}
    if family.kind == "encoder_decoder":
        data = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
        pd.DataFrame({"text": SOURCES, "target": TARGETS}).to_json(data, orient="records", lines=True)
        extra = {"dataset": str(data), "target_column": "target"}
    texts = None if extra["dataset"] else _texts(family)
    return probe.run(str(directory), texts=texts, out=tmp_path_factory.mktemp("runs"), progress=False,
                     **extra, **options)


@pytest.fixture(scope="module")
def full_runs(models, tmp_path_factory):
    """Every row of each model.  The selective runs use the same batch size: the same batches give the model the
    same inputs (another padding would change its float32 rounding, and so the problems themselves)."""
    return {name: _run(models, name, tmp_path_factory, batch_size=2).rows for name in models}


def assert_same_rows(selected: pd.DataFrame, full: pd.DataFrame):
    """Every selected row is the full run's row of the same key, within the two rows' certificates."""
    joined = selected.merge(full, on=KEY, how="left", suffixes=("", "_full"), indicator=True)
    assert (joined["_merge"] == "both").all(), joined[joined["_merge"] != "both"][KEY]
    for column in ("n_keys", "token_id", "token", "token_role", "trivial", "converged"):
        assert (joined[column] == joined[f"{column}_full"]).all(), column
    # ||lambda* - alpha z|| / ||lambda*|| moves by at most 2 (e + e') / ||lambda|| between two certified answers
    certified = 2 * (joined["error_bound"] + joined["error_bound_full"]) / joined["lambda_norm"] + 1e-12
    assert ((joined["rel_deviation"] - joined["rel_deviation_full"]).abs() <= certified).all()
    # the second order also moves with its own points' errors (at most 1e-10 ||lambda|| each, as the run asks)
    second = (joined["second_order_deviation"] - joined["second_order_deviation_full"]).abs()
    assert (second <= certified + 4e-10).all()
    for column in ("attention_tv", "output_deviation"):  # within tanh(D e / 8)-sized bounds: far below 1e-6 here
        np.testing.assert_allclose(joined[column], joined[f"{column}_full"], rtol=0, atol=1e-6, err_msg=column)
    np.testing.assert_allclose(joined["evidence_norm"], joined["evidence_norm_full"], rtol=1e-12)
    np.testing.assert_allclose(joined["attention_entropy"], joined["attention_entropy_full"], rtol=1e-10, atol=1e-12)


def _positions(rows: pd.DataFrame) -> dict:
    """(example, attention type, layer, head) -> the query positions measured there."""
    return {key: tuple(sorted(group["query"])) for key, group in rows.groupby(["example", "attention_type", "layer",
                                                                                "head"])}


@pytest.mark.parametrize("name", ["llama", "bert", "t5"])
def test_layers_heads_and_every_k_are_the_full_runs_rows(name, models, full_runs, tmp_path_factory):
    full = full_runs[name]
    heads = "0,1,3"  # on the Llama: key-value heads 0, 0, 1, repeated per query head (not in equal blocks)
    rows = _run(models, name, tmp_path_factory, layers="-1", heads=heads, queries="every:3", batch_size=2).rows
    assert_same_rows(rows, full)
    expected = full[(full["layer"] == full.groupby("attention_type")["layer"].transform("max"))
                    & full["head"].isin([0, 1, 3]) & (full["query"] % 3 == 0)]
    assert set(map(tuple, rows[KEY].to_numpy())) == set(map(tuple, expected[KEY].to_numpy()))


def test_a_causal_models_second_order_by_its_intervals_is_the_cg_rows(models, full_runs, tmp_path_factory,
                                                                      monkeypatch):
    """The Llama's rows (a causal mask after left padding: each query uniform over an interval of keys, shared by
    the query heads of a key-value head) with the second order solved by one factorisation per interval, as long
    contexts are, against the full run's, whose few keys leave it to CG."""
    monkeypatch.setattr(second_order, "_intervals_pay", lambda *args: True)
    solved, left = [], []
    solve_intervals, solve_cg = second_order._solve_intervals, second_order._solve_cg

    def counted_intervals(*args, **kwargs):
        found = solve_intervals(*args, **kwargs)
        solved.append(int(found.sum()))
        return found

    def counted_cg(*args):
        left.append(args)
        return solve_cg(*args)

    monkeypatch.setattr(second_order, "_solve_intervals", counted_intervals)
    monkeypatch.setattr(second_order, "_solve_cg", counted_cg)
    rows = _run(models, "llama", tmp_path_factory, batch_size=2).rows
    assert sum(solved) > 0.9 * len(rows) and not left  # by their intervals (the rest: classes of equal masks)
    assert_same_rows(rows, full_runs["llama"])


def test_a_memory_budget_bounds_the_derived_quantities_tiles(models, full_runs, tmp_path_factory, monkeypatch):
    """With ``max_memory``, the second order's and the attention quantities' tiles take at most a quarter of it
    each (without it, their own budgets), and the rows are the full run's within their certificates."""
    budgets = {"second_order_point": [], "attention_quantities": []}
    for module in (second_order, derived):
        for name in budgets:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, _recording(getattr(module, name), budgets[name]))
    limit = 64 << 10
    rows = _run(models, "llama", tmp_path_factory, batch_size=2, max_memory=f"{limit}B").rows
    assert all(budgets.values()) and max(max(seen) for seen in budgets.values()) <= limit // 4
    assert_same_rows(rows, full_runs["llama"])
    for seen in budgets.values():
        seen.clear()
    _run(models, "llama", tmp_path_factory, queries="last", batch_size=2)
    assert budgets["second_order_point"] and set(budgets["second_order_point"]) == {rows_module.SECOND_ORDER_BYTES}
    assert budgets["attention_quantities"] and set(budgets["attention_quantities"]) == {rows_module.ATTENTION_BYTES}


def _recording(function, seen):
    """``function``, recording the ``memory_budget_bytes`` of each call in ``seen``."""

    def recorded(*args, **kwargs):
        seen.append(kwargs["memory_budget_bytes"])
        return function(*args, **kwargs)

    return recorded


@pytest.mark.parametrize("name", ["llama", "bert", "t5"])
def test_last_keeps_each_texts_last_token(name, models, full_runs, tmp_path_factory):
    full = full_runs[name]
    rows = _run(models, name, tmp_path_factory, queries="last", heads="1-2", batch_size=2).rows
    assert_same_rows(rows, full)
    last = full.groupby(["attention_type", "example"])["query"].transform("max")
    expected = full[(full["query"] == last) & full["head"].isin([1, 2])]
    assert set(map(tuple, rows[KEY].to_numpy())) == set(map(tuple, expected[KEY].to_numpy()))


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_sample_is_min_n_tokens_the_same_at_every_site_and_head_and_batch(name, models, full_runs, tmp_path_factory):
    full, count = full_runs[name], 4
    one = _run(models, name, tmp_path_factory, queries=f"sample:{count}", seed=11, batch_size=2).rows
    other = _run(models, name, tmp_path_factory, queries=f"sample:{count}", seed=11, batch_size=5).rows
    assert_same_rows(one, full)
    assert set(map(tuple, one[KEY].to_numpy())) == set(map(tuple, other[KEY].to_numpy()))
    tokens = full.groupby(["attention_type", "example"])["query"].nunique()
    for (kind, example), group in one.groupby(["attention_type", "example"]):
        per_site = {tuple(sorted(g["query"])) for _, g in group.groupby(["layer", "head", "space", "alpha"])}
        assert len(per_site) == 1, (kind, example)  # the same positions at every site and head
        assert len(next(iter(per_site))) == min(count, tokens[(kind, example)])
    if name == "t5":  # decoder self- and cross-attention share the decoder's positions
        decoder = one[one["attention_type"].isin(["decoder_self", "cross"])]
        assert decoder.groupby("example").apply(lambda g: g.groupby("attention_type")["query"].apply(
            lambda q: tuple(sorted(set(q)))).nunique()).eq(1).all()
    reseeded = _run(models, name, tmp_path_factory, queries=f"sample:{count}", seed=12, batch_size=2).rows
    assert set(map(tuple, reseeded[KEY].to_numpy())) != set(map(tuple, one[KEY].to_numpy()))


def test_the_manifest_records_the_selection(models, tmp_path_factory):
    run = _run(models, "t5", tmp_path_factory, layers="0", attention_types="cross", queries="sample:2", seed=3)
    recorded = run.manifest["selection"]
    assert recorded["layers"] == {"cross": [0]} and recorded["queries"] == "sample:2" and recorded["seed"] == 3
    assert recorded["description"] == "attention types cross; layers 0; 2 sampled query positions per text (all of " \
                                      "a shorter text), seed 3"
    assert set(run.rows["attention_type"]) == {"cross"} and set(run.rows["layer"]) == {0}
    assert run.manifest["fidelity"]["passed"]


# --------------------------------------------------------------------------------------------------
# every family's stacks, from its config, are what its capture emits


@pytest.mark.parametrize("name", ALL)
def test_stacks_from_the_config_are_the_captured_sites(name, tmp_path, minilm_dir):
    from probe.capture.loading import load_model

    family = spec(name)
    save_tiny(family, tmp_path, minilm_dir)
    loaded = load_model(str(tmp_path), device="cpu")
    texts = list(SOURCES if family.kind == "encoder_decoder" else CORPUS)[:2]
    inputs = loaded.adapter.encode(loaded.tokenizer, texts, TARGETS[:2] if family.kind == "encoder_decoder" else None,
                                   64)
    sites = loaded.adapter.sites(loaded.model, inputs)
    emitted = {}
    for site in sites:
        layers, heads = emitted.get(site.attention_type, (0, site.shape[1]))
        emitted[site.attention_type] = (layers + 1, heads)
    assert {kind: (stack.layers, stack.heads) for kind, stack in loaded.adapter.stacks(loaded.model.config).items()} \
        == emitted
    # and a selection captures exactly the selected sites and heads
    chosen = resolve(settings(layers="-1", heads="0"), loaded.adapter.stacks(loaded.model.config))
    selected = loaded.adapter.sites(loaded.model, inputs, chosen.for_batch([0, 1]))
    assert [(s.attention_type, s.layer, s.shape[1], s.head_ids) for s in selected] == [
        (kind, layers - 1, 1, (0,)) for kind, (layers, _) in emitted.items()]


def test_a_selection_that_keeps_everything_is_everything():
    stacks = {"self": Stack(2, 4)}
    assert resolve(settings(layers="0-1", heads="-4--1", queries="all"), stacks).everything
    assert isinstance(resolve(settings(), stacks), Selection)


def test_verify_re_solves_a_selective_runs_rows(models, tmp_path_factory):
    """`probe verify` of a run that kept some heads and sampled positions: its sampled rows are found in the
    model's sites again and agree with an independent solver."""
    from probe.pipeline.verify import verify

    run = _run(models, "llama", tmp_path_factory, heads="1,3", queries="sample:3", seed=2, batch_size=2)
    report = verify(run.run_dir, sample=6, seed=0)
    assert report.ok, "\n".join(report.lines())


def test_the_report_and_compare_pages_say_what_was_measured(models, tmp_path_factory, full_runs):
    run = _run(models, "bert", tmp_path_factory, layers="0", queries="last", batch_size=2)
    page = (run.report(progress=False) / "index.html").read_text()
    assert "Measured: layers 0; the last token of each text" in page
    full = _run(models, "bert", tmp_path_factory, batch_size=2)
    where = probe.compare([full, run], out=tmp_path_factory.mktemp("compare") / "cmp")
    text = (where / "index.html").read_text()
    assert "every layer, head and query position" in text and "layers 0; the last token of each text" in text
