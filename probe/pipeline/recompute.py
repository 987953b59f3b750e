r"""A run's problems computed again from the model files its manifest names: for ``probe verify`` (a sample of
rows re-solved by an independent method) and ``probe show`` (one text at one site and head, drawn as the
model's attention against the exact posterior :math:`p^*`, :mod:`probe.report.text_view`).

The model and the texts are loaded as ``probe resume`` loads them (:func:`load_job`): refused when the model
files, the tokenizer files or the texts changed since the run (:mod:`probe.pipeline.fingerprint`, the texts'
SHA-256), so what is recomputed is what the run measured.  A text's problems are captured by running its
batch of the run's plan through the model again (:func:`batch_sites`): the same padded batch gives the same
float32 inputs to the same operations, so the captured numbers are the run's.  (A text run alone is padded
to another length, and its float32 forward rounds differently: on all-MiniLM-L6-v2 its relative deviations
then differ from the run's by about 1e-7, a thousand times what their certificates allow.)

:func:`text_view` solves the text's problems with the run's solver (:func:`probe.solve.dual.solve_dual`, the
run's tolerance) and checks every recomputed relative deviation against the stored row of the same query:
:math:`|r - r_{stored}| \le (\varepsilon + \varepsilon_{stored})(1 + r)/\|\hat\lambda\|` (the two solves'
certificates, as :mod:`probe.pipeline.verify` bounds it), refused otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from probe.core.arguments import IndexRange
from probe.core.errors import ProbeError
from probe.core.spelling import option
from probe.report.text_view import TextView

#: the absolute slack allowed on top of the certificates (the rounding of the reductions)
SLACK = 1e-12


def load_job(run_dir: Path, manifest: dict):
    """The model, texts and batch plan as resume loads them (refused if the model files or texts changed)."""
    from probe.pipeline.runner import config_from_json, prepare_resume

    if "config" not in manifest or "inputs" not in manifest:
        raise ProbeError(f"{run_dir} was written by an older probe that did not record its inputs: its problems "
                         "cannot be computed again.")
    check_model_files(run_dir, manifest)
    config = config_from_json(manifest["config"])
    config.progress = False
    return prepare_resume(run_dir, manifest, config, config.device)


def check_model_files(run_dir: Path, manifest: dict) -> None:
    """The model files the manifest names are still the run's: their fingerprint
    (:func:`probe.pipeline.fingerprint.model_fingerprint`) is the one recorded when the run started; refused,
    naming what changed, otherwise (what is computed from other files is not what the run measured).  A model
    measured in memory (:mod:`probe.callbacks`) or files that cannot be found are left to
    :func:`probe.pipeline.runner.prepare_resume`, which says so."""
    from probe.core.naming import expand_path
    from probe.pipeline import fingerprint

    inputs = manifest["inputs"]
    location, recorded = expand_path(inputs.get("model_location")), inputs.get("model_fingerprint")
    if location is None or recorded is None:
        return
    try:
        directory = fingerprint.model_directory(location, inputs.get("model_revision"))
    except OSError:
        return
    changed = fingerprint.differences(recorded, fingerprint.model_fingerprint(directory))
    if changed:
        raise ProbeError(
            f"The model files of {run_dir} changed since the run ({'; '.join(changed[:5])}"
            f"{'; ...' if len(changed) > 5 else ''}): what they compute now is not what the run measured. Restore "
            f"the files in {directory}, or measure them as they are with a new `probe run`."
        )


@dataclass
class BatchSites:
    """What :func:`batch_sites` captured: the sites kept, by (attention type, layer); the examples of the batch
    in its order; the batch's model inputs (token ids)."""

    sites: dict
    example_ids: list[int]
    inputs: dict


def batch_sites(job, batch: int, needed: set[tuple[str, int]]) -> BatchSites:
    """Run batch ``batch`` of the plan through the model again; keep the sites ``needed`` ((type, layer)), with the
    rows the run selected (its heads and query positions; :mod:`probe.capture.selection`): those are the rows it
    stored, and a few sampled positions of a long text cost a few rows, not the text's every query."""
    import torch

    positions = job.batches[batch]
    texts = [job.texts.texts[i] for i in positions]
    targets = [job.texts.targets[i] for i in positions] if job.texts.targets is not None else None
    inputs = job.loaded.adapter.encode(job.loaded.tokenizer, texts, targets, job.config.max_length)
    inputs = {key: value.to(job.device) for key, value in inputs.items()}
    sites = {}

    def keep(site):
        if (site.attention_type, site.layer) in needed:
            sites[(site.attention_type, site.layer)] = site

    example_ids = [job.texts.indices[i] for i in positions]
    chosen = None if job.selection.everything else job.selection.for_batch(example_ids)
    with torch.no_grad():  # the model runs the run's attention (probe.pipeline.job.prepare): the run's numbers
        job.loaded.adapter.capture(job.loaded.model, inputs, keep, chosen)
    return BatchSites(sites, example_ids, inputs)


@dataclass
class RowProblem:
    """The reduced problem of one row, as a reference solve takes it."""

    gram: np.ndarray  #: the Gram matrix of the templates, (k, k)
    logits: np.ndarray  #: s = T z at alpha = 1, (k,)
    evidence_sqnorm: float  #: ||z||^2 at alpha = 1
    log_u: np.ndarray  #: log u, -inf where a key is excluded, (k,)
    values: np.ndarray  #: the values v_i of the row's head, (k, d_v)


def row_problem(site, space: str, alpha: float, position: int, head: int, query: int) -> RowProblem:
    """The reduced problem of one row (``position``: its example's index in the batch; ``head`` and ``query``: the
    model's head and the query's position in its sequence, as the row records them)."""
    import torch

    from probe.capture.adapters.base import real_values, space_problems

    problems = space_problems(site, space, slice(position, position + 1))
    columns = np.flatnonzero(site.query_mask[position].cpu().numpy())
    if site.query_positions is not None:
        columns = [c for c in columns if int(site.query_positions[position, c]) == query]
        column = int(columns[0])
    else:
        column = query
    if site.head_ids is not None:  # a site of the run's selected heads: the model's head at its place among them
        head = list(site.head_ids).index(head)
    b, h, q, k = site.shape
    gram = problems.gram[0]
    if gram.dim() == 3:  # key space: one Gram matrix per key head
        gram = gram[head // (h // gram.shape[0])]
    log_u = site.log_preference.expand(b, h, q, k)[position, head, column]
    values = real_values(site)[position, head // (h // site.values.shape[1])]  # query head -> its value head
    return RowProblem(gram.cpu().numpy(), problems.logits[0, head, column].cpu().numpy(),
                      float(problems.evidence_sqnorm[0, head, column]), log_u.to(dtype=gram.dtype).cpu().numpy(),
                      values.to(torch.float64).cpu().numpy())


# --------------------------------------------------------------------------------------------------
# probe show


@dataclass
class ViewRequest:
    """Which text, site, head, space and alpha to show, completed from the run (:func:`resolve`)."""

    example: int
    layer: int
    head: int
    attention_type: str
    space: str
    alpha: float


def _listing(values) -> str:
    values = sorted(values)
    shown = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values[:12])
    return shown + (f", ... ({len(values)} in all)" if len(values) > 12 else "")


def resolve(table, example: int, layer: int, head: int, attention_type: str | None, space: str | None,
            alpha: float | None, stacks: dict | None = None) -> ViewRequest:
    """The request checked against the run's rows (``table``: its :class:`probe.query.RunTable`), before any
    model loads: the text, the attention type (the run's only one when not given), the space and alpha (the
    report's main slice when not given: hidden, alpha 1, where the run has them), the layer and the head.  Each
    one the run does not hold is refused, naming those it does.  A negative layer or head counts from the end of
    the model's stack, as ``--layers`` and ``--heads`` do, from ``stacks`` (the manifest's
    ``selection.stacks``: attention type -> its ``layers`` and ``heads``)."""
    from probe.query import where

    for name, value in (("example", example), ("layer", layer), ("head", head)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProbeError(f"{option(name)} takes a whole number, got {value!r} ({type(value).__name__}).")
    found = table.frame(f"SELECT DISTINCT attention_type, space, alpha, layer, head FROM {table.relation_name} "
                        f"WHERE {where(example=example)}")
    if found.empty:
        known = table.frame(f"SELECT min(example) AS low, max(example) AS high, count(DISTINCT example) AS n "
                            f"FROM {table.relation_name}").iloc[0]
        raise ProbeError(
            f"The run has no rows of text {option('example', example)}: its {int(known['n']):,} texts are numbered "
            f"{int(known['low'])} to {int(known['high'])} by their place in the data (blank lines counted; a "
            f"random sample keeps its texts' places). Give one of those."
        )
    types = sorted(found["attention_type"].unique())
    if attention_type is None:
        if len(types) > 1:
            raise ProbeError(f"The run has several attention types ({', '.join(types)}): name one with "
                             f"{option('attention_type', types[0])}.")
        attention_type = types[0]
    elif attention_type not in types:
        raise ProbeError(f"The run has no {option('attention_type', attention_type)} rows for this text: its attention "
                         f"types are {', '.join(types)}.")
    found = found[found["attention_type"] == attention_type]
    layer = _from_the_end("layer", layer, (stacks or {}).get(attention_type, {}).get("layers"), attention_type)
    head = _from_the_end("head", head, (stacks or {}).get(attention_type, {}).get("heads"), attention_type)
    spaces = sorted(found["space"].unique())
    if space is None:
        space = "hidden" if "hidden" in spaces else spaces[0]
    elif space not in spaces:
        raise ProbeError(f"The run has no {option('space', space)} rows: its spaces are {', '.join(spaces)}.")
    found = found[found["space"] == space]
    alphas = sorted(float(a) for a in found["alpha"].unique())
    if alpha is None:
        alpha = 1.0 if any(math.isclose(a, 1.0) for a in alphas) else alphas[0]
    else:
        matching = [a for a in alphas if math.isclose(a, float(alpha), rel_tol=1e-12)]
        if not matching:
            raise ProbeError(f"The run has no rows at {option('alpha', f'{float(alpha):g}')}: its alphas are "
                             f"{_listing(alphas)}.")
        alpha = matching[0]
    found = found[np.isclose(found["alpha"].to_numpy(dtype=float), alpha, rtol=1e-12, atol=0)]
    if layer not in set(found["layer"]):
        raise ProbeError(f"The run has no rows of {option('layer', layer)} ({attention_type}): its layers are "
                         f"{_listing(int(v) for v in found['layer'].unique())}.")
    heads = {int(v) for v in found.loc[found["layer"] == layer, "head"]}
    if head not in heads:
        raise ProbeError(f"The run has no rows of {option('head', head)} in layer {layer} ({attention_type}): its "
                         f"heads are {_listing(heads)}.")
    return ViewRequest(example, layer, head, attention_type, space, alpha)


def _from_the_end(name: str, index: int, size: int | None, attention_type: str) -> int:
    """``index`` as counted from 0: a negative one counts back from the stack's ``size`` (-1 is the last)."""
    if index >= 0:
        return index
    if size is None:
        raise ProbeError(f"{option(name, index)}: this run's manifest does not record how many {name}s the model's "
                         f"{attention_type} stack has, so count from 0.")
    counted = IndexRange.resolve_end(size, index)  # as --layers and --heads count it
    if counted is None:
        raise ProbeError(f"{option(name, index)} is out of range: the model's {attention_type} stack has {size} {name}s, "
                         f"0 to {size - 1} (or -{size} to -1).")
    return counted


def stored_rows(table, request: ViewRequest):
    """The run's rows of the request's text, site and head, in query order (a pandas DataFrame)."""
    from probe.query import where

    condition = where(example=request.example, layer=request.layer, head=request.head,
                      attention_type=request.attention_type, space=request.space, alpha=request.alpha)
    return table.frame(f"SELECT query, rel_deviation, error_bound, lambda_norm FROM {table.relation_name} "
                       f"WHERE {condition} ORDER BY query")


def text_view(run_dir: str | Path, example: int, layer: int, head: int, *, attention_type: str | None = None,
              space: str | None = None, alpha: float | None = None, allow_damaged: bool = False) -> TextView:
    """One text of a run at one site and head (:class:`probe.report.text_view.TextView`), recomputed from the
    model files the manifest names and checked against the run's stored rows (see the module).  Every
    argument is checked against the run before the model loads (:func:`resolve`)."""
    from probe.query import RunTable
    from probe.report.data import model_of, run_title
    from probe.store.storage import read_manifest

    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    with RunTable.open(run_dir, allow_damaged=allow_damaged) as table:
        request = resolve(table, example, layer, head, attention_type, space, alpha,
                          stacks=(manifest.get("selection") or {}).get("stacks"))
        stored = stored_rows(table, request)
    job = load_job(run_dir, manifest)
    position = job.texts.indices.index(request.example)
    batch = next(number for number, positions in enumerate(job.batches) if position in positions)
    captured = batch_sites(job, batch, {(request.attention_type, request.layer)})
    row = captured.example_ids.index(request.example)
    view = _solved_view(captured, row, request, job)
    view.run, view.model = run_title(manifest), model_of(manifest)
    view.text = job.texts.texts[position]
    view.largest_ratio = _check(view, stored, run_dir)
    return view


def _solved_view(captured: BatchSites, row: int, request: ViewRequest, job) -> TextView:
    """The request's site and head for the text in row ``row`` of the batch: solved, with its tokens."""
    import torch

    from probe.batch.problems import dual_problems, select
    from probe.capture.adapters.base import space_problems
    from probe.solve.dual import solve_dual

    site = select(captured.sites[(request.attention_type, request.layer)], slice(row, row + 1))
    built = space_problems(site, request.space)
    problems = dual_problems(site, built, request.alpha)
    # the model's probabilities; a run of its fast attention (SDPA) never formed them: there the ones rebuilt from
    # the logits, which the fidelity check held to the model's own output
    attention = (torch.softmax(site.log_preference + built.logits, dim=-1) if site.model_probs is None
                 else site.model_probs)
    solution = solve_dual(problems, rtol=job.config.rtol)
    _, h, q, k = site.shape
    head = request.head if site.head_ids is None else list(site.head_ids).index(request.head)
    queries = np.flatnonzero(site.query_mask[0].cpu().numpy())
    keys = np.flatnonzero(site.key_mask[0].cpu().numpy())

    def per_query(values: torch.Tensor) -> np.ndarray:
        return values.reshape(1, h, q, *values.shape[2:])[0, head].to(torch.float64).cpu().numpy()[queries]

    positions = queries if site.query_positions is None else site.query_positions[0].cpu().numpy()[queries]
    tokenizer = job.loaded.tokenizer
    key_ids = captured.inputs.get("decoder_input_ids" if request.attention_type == "decoder_self" else "input_ids")
    key_ids = key_ids[row].cpu().numpy() if key_ids is not None and key_ids.shape[-1] == k else None
    return TextView(
        run="", model="", example=request.example, attention_type=request.attention_type, layer=request.layer,
        head=request.head, space=request.space, alpha=request.alpha, text="",
        query_tokens=tokenizer.convert_ids_to_tokens([int(i) for i in site.query_ids[0].cpu().numpy()[queries]]),
        key_tokens=(tokenizer.convert_ids_to_tokens([int(i) for i in key_ids[keys]]) if key_ids is not None
                    else [str(i) for i in keys]),
        query_positions=[int(p) for p in positions],
        attention=attention[0, head].to(torch.float64).cpu().numpy()[np.ix_(queries, keys)],
        posterior=per_query(solution.attention)[:, keys],
        rel_deviation=per_query(solution.rel_deviation), error_bound=per_query(solution.error_bound),
        lambda_norm=per_query(solution.lambda_norm), stored_rel_deviation=np.full(len(queries), np.nan),
        largest_ratio=0.0, rebuilt=site.model_probs is None,
    )


def _check(view: TextView, stored, run_dir: Path) -> float:
    """Each recomputed relative deviation against the stored row of its query, within the two certificates;
    the largest difference as a share of what they allow.  A stored row the recomputation does not have, or a
    difference beyond the certificates, is refused: the run's rows are not what its files compute."""
    at = {position: index for index, position in enumerate(view.query_positions)}
    largest = 0.0
    for record in stored.to_dict("records"):
        index = at.get(int(record["query"]))
        if index is None:
            raise ProbeError(f"{run_dir} has a row at query {record['query']} of text {view.example}, which the model "
                             "no longer produces: the text or the tokenizer changed. Start a new run with `probe run`.")
        view.stored_rel_deviation[index] = record["rel_deviation"]
        allowed = ((view.error_bound[index] + record["error_bound"]) * (1 + view.rel_deviation[index])
                   / record["lambda_norm"] + SLACK)
        ratio = abs(view.rel_deviation[index] - record["rel_deviation"]) / allowed
        if not ratio <= 1.0:
            raise ProbeError(
                f"The recomputed rows of text {view.example} ({view.attention_type} layer {view.layer} head "
                f"{view.head}) differ from those {run_dir} stores beyond their certificates (query "
                f"{record['query']}: {view.rel_deviation[index]:.12g} now, {record['rel_deviation']:.12g} stored, "
                f"{ratio:.3g} times what the certificates allow): the run was made by other code or on other "
                "hardware. `probe verify` checks its rows; a new `probe run` measures the files as they are."
            )
        largest = max(largest, ratio)
    return largest
