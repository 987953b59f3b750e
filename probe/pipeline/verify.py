r"""``probe verify RUN_DIR``: check a finished run against itself, after the fact.

Two checks:

1. **Every part file** against its record in the manifest (:func:`probe.store.integrity.check_parts` with
   SHA-256 checksums): present, of its recorded size, row count and checksum.
2. **A seeded random sample of rows re-solved from the model** by an independent method.  The model
   and the texts are loaded as ``probe resume`` loads them (refused if their files changed), the batch
   each sampled row came from is run through the model again (the same batch, so the same captured
   numbers), and each sampled row's problem is rebuilt in explicit form,
   :math:`T, z` with :math:`TT^\top = G`, :math:`Tz = s` (:func:`probe.solve.reference.templates_from_reduced`),
   and its dual (D) :math:`\max_\lambda \langle\lambda, \mu + z\rangle - \|\lambda\|^2/(2\alpha) -
   \log\sum_i u_i e^{\langle t_i, \lambda\rangle}` is maximised by plain gradient ascent with step
   :math:`1/L` (:func:`probe.solve.reference.gradient_ascent_dual`, the paper's method, sharing no code with
   the production Newton-CG of :mod:`probe.solve.dual`).  Strong concavity (modulus :math:`1/\alpha`)
   certifies the reference: :math:`\|\lambda_{ref} - \lambda^*\| \le \varepsilon_{ref} =
   \alpha\|\nabla D(\lambda_{ref})\|`.  Where gradient ascent is slow (ill-conditioned problems: it
   stops after :data:`REFERENCE_MAX_ITER` steps), dense Newton steps on the full dual continue from its
   point (the Hessian :math:`-(I/\alpha + T^\top(\mathrm{diag}\,p - pp^\top)T)` formed and solved
   directly), each kept only if it shrinks the certificate; a row whose reference certificate stays
   above :data:`REFERENCE_USEFUL` of :math:`\|\lambda\|` counts as not re-solved, and verify fails.

Each stored number is compared with the reference's against what the two certificates allow, with
:math:`\delta = \varepsilon + \varepsilon_{ref}` (``error_bound`` of the row plus the reference's):

* ``rel_deviation`` :math:`= \|\lambda - \alpha z\|/\|\lambda\|`: :math:`|\Delta| \le \delta(1 + r_{ref})
  / \|\lambda\|` (the quotient's perturbation bound);
* ``lambda_norm``: :math:`|\Delta| \le \delta`;
* ``attention_tv`` :math:`= \tfrac12\|p(\lambda) - p_{att}\|_1`: :math:`|\Delta| \le \max_i\|t_i\|\,\delta`
  (a softmax moves by at most :math:`2\|\Delta\theta\|_\infty` in :math:`\ell_1`);
* ``evidence_norm`` :math:`\|\alpha z\|` and ``attention_entropy`` (functions of the captured inputs
  only): equal up to rounding, :math:`10^{-9}` relative;
* ``second_order_deviation`` :math:`= \|\lambda^* - \lambda_2\|/\|\lambda^*\|`: the manifest's
  ``max_derived_bound`` of the column (the run's largest certified bound; the row does not store the
  error of its second-order solve) plus the reference's own quotient bound (:func:`_reference_derived`,
  :math:`\lambda_2` by one dense solve);
* ``output_deviation``: :math:`(2\tanh(D\varepsilon/4) + 2\tanh(D\varepsilon_{ref}/4))R /
  \|\sum_i p_{att,i}v_i\|` (:mod:`probe.solve.derived`'s softmax lemma and output bound, on the row's
  template diameter :math:`D` and values' radius :math:`R`);

each with an absolute slack of :data:`SLACK` for the rounding of the reduction.  Both derived columns
are recomputed from the reference solution by dense float64 linear algebra on the explicit templates
(with the values of the row's head, captured again with its batch), not by :mod:`probe.solve.derived`.

The interventions table of a run made with ``--intervene`` has its part checksums checked too.

Cost: the checksums read every part once; then the model loads once and runs one forward pass per
batch that holds a sampled row (at most ``sample`` batches, usually fewer), and each sampled row costs
one reference solve (gradient ascent: a few hundred to some thousands of tiny steps), plus one dense
solve of size rank(G) + 1 for the derived columns.  Measured: the
default 64 rows of an all-MiniLM-L6-v2 run (46 batches re-run), 6 to 25 s on a shared 2-core machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from probe.core import arguments
from probe.core.environment import check_environment
from probe.core.errors import ProbeError
from probe.core.schema import ROW_KEY
from probe.pipeline.recompute import batch_sites, load_job, row_problem
from probe.store import aggregates, integrity, storage

#: absolute slack added to every bound: rounding of the explicit form rebuilt from the reduced one
SLACK = 1e-9
#: relative agreement required of the quantities computed from the captured inputs alone
INPUT_RTOL = 1e-9
#: the reference's stopping tolerance (relative to ||lambda||) and gradient ascent's iteration cap
REFERENCE_TOL = 1e-11
REFERENCE_MAX_ITER = 20_000
#: the largest relative certificate of the reference that still verifies something: beyond it the row
#: counts as not re-solved (the bounds, which include the reference's certificate, would be too loose)
REFERENCE_USEFUL = 1e-7
COLUMNS = ("rel_deviation", "lambda_norm", "attention_tv", "evidence_norm", "attention_entropy",
           "second_order_deviation", "output_deviation")


@dataclass
class ColumnCheck:
    """The largest difference of one column over the sample, and how it compares with its bound."""

    column: str
    max_abs_difference: float = 0.0
    worst_ratio: float = 0.0  # max of |difference| / bound over the sample (<= 1: holds)
    worst_row: dict | None = None
    failures: int = 0
    note: str = ""  # what limits the check, printed with it

    @property
    def holds(self) -> bool:
        return self.failures == 0


@dataclass
class VerifyReport:
    run_dir: Path
    parts: integrity.PartsCheck
    sampled: int = 0
    seed: int = 0
    columns: dict[str, ColumnCheck] = field(default_factory=dict)
    reference_not_converged: int = 0
    batches_rerun: int = 0
    #: the interventions table's parts (a run with ``--intervene``), checked like the rows'; None without
    intervention_parts: integrity.PartsCheck | None = None
    #: a run with ``--keep``: its aggregates' parts checked like the rows' (None once merged), and what is wrong
    #: with its merged file ("" when it matches its record; None: no merged file)
    aggregate_parts: integrity.PartsCheck | None = None
    merged_problem: str | None = None
    kept: str = "rows"

    @property
    def ok(self) -> bool:
        return (self.parts.ok and (self.intervention_parts is None or self.intervention_parts.ok)
                and (self.aggregate_parts is None or self.aggregate_parts.ok) and not self.merged_problem
                and not self.reference_not_converged
                and all(check.holds for check in self.columns.values()))

    def lines(self) -> list[str]:
        parts = self.parts
        out = [
            f"parts: {len(parts.readable)} of {parts.batches_total} batches checked against their SHA-256 records"
            + ("" if parts.ok else f"; DAMAGED: {parts.describe()} (repair with: probe resume {self.run_dir})"),
        ]
        if parts.unrecorded:
            out.append(f"  {len(parts.unrecorded)} part(s) not yet recorded (footers checked only)")
        extra = self.intervention_parts
        if extra is not None:
            out.append(f"{storage.INTERVENTIONS}: {len(extra.readable)} of {extra.batches_total} batches checked "
                       "against their SHA-256 records" + ("" if extra.ok else f"; DAMAGED: {extra.describe()} "
                                                          f"(repair with: probe resume {self.run_dir})"))
        if self.aggregate_parts is not None:
            extra = self.aggregate_parts
            out.append(f"{storage.AGGREGATES}: {len(extra.readable)} of {extra.batches_total} batches checked against "
                       "their SHA-256 records" + ("" if extra.ok else f"; DAMAGED: {extra.describe()} (repair with: "
                                                  f"probe resume {self.run_dir})"))
        if self.merged_problem is not None:
            out.append(f"{storage.AGGREGATES}/{aggregates.MERGED}: checked against its SHA-256 record"
                       + (f"; DAMAGED: {self.merged_problem} (repair with: probe resume {self.run_dir})"
                          if self.merged_problem else ""))
        if self.kept == "aggregates":
            out.append("re-solved: none: the run kept only its statistics (--keep aggregates), no row to re-solve")
        out.append(f"re-solved: {self.sampled} rows (seed {self.seed}) from {self.batches_rerun} batch(es) re-run "
                   "through the model, by gradient ascent on the full dual (probe.solve.reference; Newton steps where "
                   "it is slow)")
        if self.reference_not_converged:
            out.append(f"  the reference's certificate stayed above {REFERENCE_USEFUL:g} of ||lambda|| on "
                       f"{self.reference_not_converged} row(s): those rows are not verified")
        for check in self.columns.values():
            verdict = "holds" if check.holds else f"FAILS on {check.failures} row(s)"
            where = ""
            if check.worst_row is not None:
                row = check.worst_row
                where = (f" (worst: layer {row['layer']} head {row['head']} example {row['example']} query "
                         f"{row['query']}, {row['space']} alpha={row['alpha']:g}: stored {row['stored']:.12g}, "
                         f"reference {row['reference']:.12g})")
            out.append(f"  {check.column}: largest difference {check.max_abs_difference:.2e}, "
                       f"{check.worst_ratio:.2g} of its bound: {verdict}{where}{check.note}")
        out.append("verified: every check holds" if self.ok else "NOT verified: see above")
        return out


def sample_rows(check: integrity.PartsCheck, sample: int, seed: int) -> pa.Table:
    """``sample`` rows drawn uniformly (without replacement, seeded) from the readable parts, with the
    batch each came from.  The draw is over the rows' positions (the parts in batch order, each part's rows
    in its order), numbered from the parts' footers; then only the row groups that hold a drawn row are read,
    one at a time, so memory holds one row group, whatever the run's size."""
    wanted = list(ROW_KEY) + list(COLUMNS) + ["error_bound", "n_keys"]
    if not check.readable:
        raise ProbeError(f"{check.run_dir} has no finished batches: nothing to verify.")
    groups = []  # (batch, part file, row group, its rows), in the order of the positions
    for batch, path in sorted(check.readable.items()):
        metadata = pq.read_metadata(path)
        groups += [(batch, path, group, metadata.row_group(group).num_rows) for group in range(metadata.num_row_groups)]
    total = sum(rows for *_, rows in groups)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(total, size=min(sample, total), replace=False))
    tables, start = [], 0
    for batch, path, group, rows in groups:
        here = chosen[np.searchsorted(chosen, start):np.searchsorted(chosen, start + rows)] - start
        if len(here):
            with pq.ParquetFile(path) as part:
                table = part.read_row_group(group, columns=wanted).take(pa.array(here))
            tables.append(table.append_column("batch", pa.array(np.full(len(here), batch, np.int64))))
        start += rows
    if not tables:  # parts without rows: an empty sample with the columns it would have
        table = pq.read_schema(next(iter(check.readable.values()))).empty_table().select(wanted)
        return table.append_column("batch", pa.array([], pa.int64()))
    return pa.concat_tables(tables)


def _reference(gram, logits, evidence_sqnorm, log_u, alpha, values=None):
    """The row's quantities from the reference solve of its full dual, with the reference's certificate."""
    import torch

    from probe.solve.reference import gradient_ascent_dual, templates_from_reduced

    T, z1 = templates_from_reduced(gram, logits, evidence_sqnorm)  # alpha = 1: T z1 = s
    z = z1 / alpha
    lam, _ = gradient_ascent_dual(torch.from_numpy(T)[None], torch.from_numpy(z)[None],
                                  torch.from_numpy(log_u)[None], alpha, tol=REFERENCE_TOL,
                                  max_iter=REFERENCE_MAX_ITER)
    lam = lam[0].numpy()
    keep = np.isfinite(log_u)
    log_u_n = log_u[keep] - np.logaddexp.reduce(log_u[keep])
    T_s = T[keep]
    b = T_s.T @ np.exp(log_u_n) + z

    def softmax(theta):
        theta = theta - theta.max()
        weights = np.exp(theta)
        return weights / weights.sum()

    def certificate(point):  # ||point - lam*|| <= alpha ||grad D(point)|| (1/alpha-strong concavity)
        p = softmax(log_u_n + T_s @ point)
        return alpha * float(np.linalg.norm(b - point / alpha - T_s.T @ p))

    epsilon = certificate(lam)
    for _ in range(50):  # ill-conditioned: gradient ascent is slow; dense Newton steps on the full dual
        if epsilon <= REFERENCE_TOL * np.linalg.norm(lam):
            break
        p = softmax(log_u_n + T_s @ lam)
        gradient = b - lam / alpha - T_s.T @ p
        covariance = (T_s * p[:, None]).T @ T_s - np.outer(T_s.T @ p, T_s.T @ p)  # T^T (diag p - p p^T) T
        step = np.linalg.solve(np.eye(len(lam)) / alpha + covariance, gradient)  # -H^-1 grad D
        length = 1.0
        while length > 1e-8 and certificate(lam + length * step) >= epsilon:
            length *= 0.5  # judged by the certificate itself: each accepted step makes it smaller
        if length <= 1e-8:
            break
        lam = lam + length * step
        epsilon = certificate(lam)
    p_star = softmax(log_u_n + T_s @ lam)
    log_p_att = log_u_n + T_s @ (alpha * z)
    log_p_att = log_p_att - np.logaddexp.reduce(log_p_att)
    p_att = np.exp(log_p_att)
    norm = float(np.linalg.norm(lam))
    derived = _reference_derived(T_s, z, np.exp(log_u_n), alpha, lam, epsilon, p_star, p_att,
                                 None if values is None else np.asarray(values, dtype=float)[keep])
    return {
        **derived,
        "rel_deviation": float(np.linalg.norm(lam - alpha * z)) / norm,
        "lambda_norm": norm,
        "attention_tv": 0.5 * float(np.abs(p_star - p_att).sum()),
        "evidence_norm": float(np.linalg.norm(alpha * z)),
        "attention_entropy": float(-(p_att * log_p_att).sum()),
        "epsilon": epsilon,
        "max_template_norm": float(np.sqrt(max(np.diag(gram)[keep].max(), 0.0))) if keep.any() else 0.0,
        "converged": epsilon <= REFERENCE_USEFUL * norm,
    }


def _reference_derived(T_s, z, u, alpha, lam, epsilon, p_star, p_att, values) -> dict:
    r"""``second_order_deviation`` and ``output_deviation`` of the reference solution, by dense float64
    linear algebra on the explicit templates (none of :mod:`probe.solve.derived`'s reduced systems, CG or tiles),
    with what each may differ from the exact value.

    * :math:`\lambda_2 = \alpha(I + \alpha\Sigma_u)^{-1}z`, :math:`\Sigma_u = \sum_i u_i (t_i - \mu)(t_i -
      \mu)^\top`, by one dense solve; its residual :math:`\rho = \alpha z - (I + \alpha\Sigma_u)\hat\lambda_2`
      bounds its error, :math:`\|\hat\lambda_2 - \lambda_2\| \le \|\rho\| =: \varepsilon_{2,ref}` (the matrix
      is :math:`\succeq I`).  :math:`v_{ref} = \|\lambda_{ref} - \hat\lambda_2\| / \|\lambda_{ref}\|` has a
      numerator within :math:`\varepsilon_{ref} + \varepsilon_{2,ref}` of :math:`\|\lambda^* - \lambda_2\|`
      and a denominator within :math:`\varepsilon_{ref}` of :math:`\|\lambda^*\|`, so :math:`|v_{ref} - v|
      \le (\varepsilon_{ref} + \varepsilon_{2,ref} + v_{ref}\varepsilon_{ref}) / (\|\lambda_{ref}\| -
      \varepsilon_{ref})` (:mod:`probe.solve.derived`'s quotient bound, here from the reference's certificates).
    * :math:`o_{ref} = \|\sum_i (p_i(\lambda_{ref}) - p_{att,i}) v_i\| / \|\sum_i p_{att,i} v_i\|`, with the
      template diameter :math:`D` and the values' radius :math:`R = \min_{c \in \{0, \bar v\}}\max_i\|v_i -
      c\|` over the row's keys that :func:`_bounds` needs (``values=None``: not computed)."""
    dimension = len(lam)
    centred = T_s - u @ T_s  # t_i - mu
    sigma = centred.T @ (u[:, None] * centred)  # Sigma_u = T^T (diag u - u u^T) T
    system = np.eye(dimension) + alpha * sigma
    lam2 = np.linalg.solve(system, alpha * z)
    epsilon2 = float(np.linalg.norm(alpha * z - system @ lam2))
    norm = float(np.linalg.norm(lam))
    second = float(np.linalg.norm(lam - lam2)) / norm
    out = {
        "second_order_deviation": second,
        "second_order_bound": ((epsilon + epsilon2 + second * epsilon) / (norm - epsilon) if norm > epsilon
                               else math.inf),
        "template_diameter": float(np.sqrt(max(
            (np.sum(T_s**2, 1)[:, None] + np.sum(T_s**2, 1)[None, :] - 2 * T_s @ T_s.T).max(), 0.0))),
    }
    if values is not None:
        output_att = p_att @ values
        out["output_norm"] = float(np.linalg.norm(output_att))
        change = float(np.linalg.norm((p_star - p_att) @ values))
        out["output_deviation"] = change / out["output_norm"] if out["output_norm"] > 0 else math.nan  # 0/0
        out["values_radius"] = float(min(np.linalg.norm(values, axis=1).max(),
                                         np.linalg.norm(values - values.mean(0), axis=1).max()))
        out["values_scale"] = float(np.linalg.norm(values, axis=1).max())
    return out


def _bounds(stored: dict, ref: dict, derived_bounds: dict | None = None) -> dict:
    """What each column's difference may be, given the two certificates (see the module's docstring)."""
    delta = float(stored["error_bound"]) + ref["epsilon"]
    result = {
        "rel_deviation": delta * (1 + ref["rel_deviation"]) / float(stored["lambda_norm"]) + SLACK,
        "lambda_norm": delta + SLACK,
        "attention_tv": ref["max_template_norm"] * delta + SLACK,
        "evidence_norm": INPUT_RTOL * ref["evidence_norm"] + SLACK,
        "attention_entropy": INPUT_RTOL * max(1.0, abs(ref["attention_entropy"])) + SLACK,
        # the run's side: the manifest's largest certified bound of the column over its rows
        # (probe.solve.derived: (eps + eps_2 + v eps) / (||lambda|| - eps), eps_2 of the run's second-order
        # solve, which the row does not store); the reference's side: its own quotient bound
        # (_reference_derived)
        "second_order_deviation": (derived_bounds or {}).get("second_order_deviation", math.inf)
        + ref["second_order_bound"] + SLACK,
    }
    if "output_norm" in ref:
        # |o_hat - o_ref| <= ||p_hat - p_ref||_1 R / ||sum_i p_att_i v_i|| (sum_i (p_hat - p_ref)_i = 0, so
        # any centre c of the values may be subtracted: probe.solve.derived's output bound).  p_hat = p(lambda_hat)
        # with ||lambda_hat - lambda*|| <= eps and p_ref = p(lambda_ref) within eps_ref: their logits
        # differ from p*'s by an oscillation of at most D eps (D eps_ref), and the softmax lemma of
        # probe.solve.derived gives TV <= tanh(D eps / 4), so ||p_hat - p_ref||_1 <= 2 tanh(D eps / 4) +
        # 2 tanh(D eps_ref / 4).  (The run certifies p_hat within eps/2; eps is the looser, row-stored
        # side.)  Plus the rounding of the two p_att: INPUT_RTOL of the values' scale.
        diameter = ref["template_diameter"]
        moved = 2 * (math.tanh(diameter * float(stored["error_bound"]) / 4) + math.tanh(diameter * ref["epsilon"] / 4))
        spread = moved * ref["values_radius"] + INPUT_RTOL * ref["values_scale"]
        result["output_deviation"] = spread / ref["output_norm"] + SLACK if ref["output_norm"] > 0 else math.inf
    return result


def verify(run_dir: Path, *, sample: int = 64, seed: int = 0) -> VerifyReport:
    """Check every part's checksum and re-solve ``sample`` rows drawn with ``seed`` (see the module)."""
    check_environment()
    arguments.seed(seed)
    run_dir = Path(run_dir)
    manifest = storage.read_manifest(run_dir)
    parts = integrity.check_parts(run_dir, manifest, checksums=True)
    report = VerifyReport(run_dir, parts, seed=seed, columns={c: ColumnCheck(c) for c in COLUMNS})
    if storage.INTERVENTIONS in storage.run_tables(manifest):
        report.intervention_parts = integrity.check_parts(run_dir, manifest, checksums=True,
                                                        table=storage.INTERVENTIONS)
    report.kept = str((manifest.get("config") or {}).get("keep", "rows"))
    if storage.AGGREGATES in storage.run_tables(manifest):
        report.aggregate_parts = integrity.check_parts(run_dir, manifest, checksums=True, table=storage.AGGREGATES)
    if manifest.get(aggregates.MERGED_RECORD):
        report.merged_problem = aggregates.merged_problem(run_dir, manifest) or ""
    if sample <= 0 or not parts.readable:
        return report
    rows = sample_rows(parts, sample, seed).to_pylist()
    if not rows:  # a run that kept no rows (--keep aggregates)
        return report
    report.sampled = len(rows)
    job = load_job(run_dir, manifest)
    derived_bounds = (manifest.get("solver") or {}).get("max_derived_bound") or {}
    if "second_order_deviation" not in derived_bounds:  # (every run that records its inputs records it)
        report.columns["second_order_deviation"].note = (
            "; the manifest records no certified bound for it, so only a non-finite value can fail")
    by_batch: dict[int, list[dict]] = {}
    for row in rows:
        by_batch.setdefault(row["batch"], []).append(row)
    for batch, batch_rows in sorted(by_batch.items()):
        captured = batch_sites(job, batch, {(r["attention_type"], r["layer"]) for r in batch_rows})
        sites, example_ids = captured.sites, captured.example_ids
        report.batches_rerun += 1
        for row in batch_rows:
            site = sites.get((row["attention_type"], row["layer"]))
            if site is None or row["example"] not in example_ids:
                raise ProbeError(
                    f"Batch {batch} of {run_dir} holds a row ({row['attention_type']} layer {row['layer']}, example "
                    f"{row['example']}) that the run's batch plan does not produce: the part does not belong to "
                    f"this run. Move it away and run `probe resume {run_dir}`."
                )
            problem = row_problem(site, row["space"], row["alpha"], example_ids.index(row["example"]),
                                   row["head"], row["query"])
            ref = _reference(problem.gram, problem.logits, problem.evidence_sqnorm, problem.log_u, row["alpha"],
                             problem.values)
            if not ref["converged"]:
                report.reference_not_converged += 1
            bounds = _bounds(row, ref, derived_bounds)
            for column, check in report.columns.items():
                stored = row[column]
                if stored is None:
                    difference = math.inf
                elif math.isnan(stored) and math.isnan(ref[column]):  # undefined for both (0/0)
                    difference = 0.0
                else:
                    difference = abs(float(stored) - ref[column])
                ratio = difference / bounds[column]
                check.max_abs_difference = max(check.max_abs_difference, difference)
                if not ratio <= 1.0:
                    check.failures += 1
                if check.worst_row is None or not ratio <= check.worst_ratio:
                    check.worst_ratio = ratio
                    check.worst_row = {**{k: row[k] for k in ROW_KEY}, "stored": stored, "reference": ref[column]}
    return report
