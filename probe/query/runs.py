"""A run's deviations table as the DuckDB view ``rows`` (:class:`RunTable`): its checked part files or one
exported file, every column of the schema, the memory check before rows are materialised."""

from __future__ import annotations

import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from probe.core.errors import ProbeError
from probe.query.sql import both
from probe.query.table import Table
from probe.store.engine import (
    MEMORY_BUDGET_ENV,
    connect,
    memory_budget,
    name,
    parquet_source,
    same_columns,
    sql_string,
)

#: columns the report cannot do without
NEEDED_COLUMNS = ("attention_type", "layer", "head", "example", "query", "rel_deviation", "converged")
#: columns a version-1 run may lack (:data:`probe.store.storage.FORMAT_VERSION`; read as nulls, ``trivial``
#: then from ``n_keys``)
OPTIONAL_COLUMNS = (
    "alpha", "space", "n_keys", "trivial", "token", "token_role", "second_order_deviation",
    "attention_tv", "output_deviation", "evidence_norm", "attention_entropy",
)
#: columns of a version-1 run, read when present: ``model`` (the model on every row, where a run of version 2
#: names it once, in the manifest)
LEGACY_COLUMNS = ("model",)
#: the view's name for readers' SQL
ROWS = "rows"
RUN_HINT = "Re-run `probe run`; a run killed before it finished can leave a parquet file without its footer."
#: bytes a row takes as a pandas DataFrame of every column (measured: 550 at 3.65M rows, sort included)
ROW_BYTES = 600
#: bytes per value of one column of a pandas slice, by kind (strings: a Python object each)
VALUE_BYTES = {"string": 64, "boolean": 1}


def _kind(arrow_type) -> str:
    """Coarse kind of an Arrow type (dictionary-encoded columns count as their values)."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    for kind, test in (
        ("boolean", pa.types.is_boolean),
        ("integer", pa.types.is_integer),
        ("floating", pa.types.is_floating),
        ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
        ("null", pa.types.is_null),
    ):
        if test(arrow_type):
            return kind
    return str(arrow_type)


_SQL_TYPES = {"string": "VARCHAR", "integer": None, "floating": "DOUBLE", "boolean": "BOOLEAN"}


def _sql_type(arrow_type) -> str:
    import pyarrow as pa

    if pa.types.is_int64(arrow_type):
        return "BIGINT"
    if pa.types.is_integer(arrow_type):
        return "INTEGER"
    return _SQL_TYPES[_kind(arrow_type)]


class RunTable(Table):
    """A run's deviations table as the DuckDB view ``rows`` (module docstring): lazy, read in place.

    >>> table = RunTable.open("runs/all-MiniLM-L6-v2-20261125-101500")
    >>> table.sql("SELECT layer, head, avg(rel_deviation) FROM rows WHERE NOT trivial GROUP BY ALL").df()
    >>> table.stats("rel_deviation", [("layer", "head")], where(alpha=1.0, trivial=False),
    ...             quantiles={"median": 0.5, "p95": 0.95})[0]
    """

    def __init__(self, path: str | Path, files: Iterable[str | Path] | None = None, *, connection=None,
                 view: str = ROWS, check=None):
        path = Path(path)
        self.files = sorted(str(f) for f in files) if files is not None else (
            sorted(str(p) for p in path.iterdir() if re.match(r"^part-\d+\.parquet$", p.name)) if path.is_dir()
            else [str(path)])
        #: the check of the run's parts (:class:`probe.store.integrity.PartsCheck`), when the table was opened from a run
        self.check = check
        self.schema, self._same_columns = _checked_schema(path, self.files)
        super().__init__(connection if connection is not None else connect(), name(view), path)
        self._owns_connection = connection is None
        self.view = view
        self._scratch: Path | None = None
        self.execute(f"CREATE OR REPLACE TEMP VIEW {name(view)} AS {self._view_sql()}")

    @classmethod
    def open(cls, run_dir: str | Path, *, allow_damaged: bool = False, manifest: dict | None = None,
             connection=None, view: str = ROWS) -> "RunTable":
        """A run directory's table after :func:`probe.store.integrity.require_intact`: a damaged run is refused
        unless ``allow_damaged`` (then its intact parts are read and :attr:`check` says what is left out).
        A single ``deviations.parquet`` file (a version-1 run's, an export) is read as it is."""
        from probe.store.integrity import require_intact
        from probe.store.storage import PARTS

        run_dir = Path(run_dir)
        path = run_dir / PARTS
        if path.is_dir():
            check = require_intact(run_dir, manifest, allow_damaged=allow_damaged)
            return cls(path, check.readable.values(), connection=connection, view=view, check=check)
        return cls(path, connection=connection, view=view)

    def _view_sql(self) -> str:
        from probe.core.schema import DEVIATION_SCHEMA

        present = set(self.schema.names) if self.schema is not None else set()
        columns = []
        for field in DEVIATION_SCHEMA:
            sql_type = _sql_type(field.type)
            if field.name not in present:
                expression = f"CAST(NULL AS {sql_type})"
            elif sql_type == "DOUBLE":
                column = name(field.name)
                expression = f"CASE WHEN isnan({column}) THEN NULL ELSE CAST({column} AS DOUBLE) END"
            else:
                expression = f"CAST({name(field.name)} AS {sql_type})"
            columns.append((field.name, expression))
        columns = dict(columns)
        columns["trivial"] = f"coalesce({columns['trivial']}, {columns['n_keys']} = 1, FALSE)"
        columns["converged"] = f"coalesce({columns['converged']}, FALSE)"
        for legacy in LEGACY_COLUMNS:
            if legacy in present:
                columns[legacy] = f"CAST({name(legacy)} AS VARCHAR)"
        selected = ", ".join(f"{expression} AS {name(column)}" for column, expression in columns.items())
        if not self.files:
            return f"SELECT {selected} FROM (SELECT 1) WHERE FALSE"
        return f"SELECT {selected} FROM {parquet_source(self.files, union_by_name=not self._same_columns)}"

    # ---- the lazy handle

    def sql(self, query: str):
        """``query`` as a lazy DuckDB relation (``.df()``, ``.arrow()``, ``.fetchall()``, or more SQL on it);
        the run's rows are the view ``rows``."""
        return self.connection.sql(query)

    @property
    def relation(self):
        """The rows as a lazy DuckDB relation (``.filter(...)``, ``.aggregate(...)``, ``.df()``)."""
        return self.connection.view(self.view)

    @property
    def stored_columns(self) -> list[str]:
        """The columns the part files hold, in their order (a version-1 run's ``model`` column left out)."""
        return [c for c in (self.schema.names if self.schema is not None else []) if c not in LEGACY_COLUMNS]

    def count(self, where_sql: str = "TRUE") -> int:
        """The number of rows satisfying ``where_sql``."""
        return int(self.execute(f"SELECT count(*) FROM {self.relation_name} WHERE {where_sql}").fetchall()[0][0])

    def row_count(self) -> int:
        """Every row of the run, from the part files' footers (reads no rows)."""
        if not self.files:
            return 0
        source = parquet_source(self.files, union_by_name=not self._same_columns)
        return int(self.execute(f"SELECT count(*) FROM {source}").fetchall()[0][0])

    @property
    def view_columns(self) -> list[str]:
        """The columns of the view ``rows``, in its order (every column of the schema, and legacy ones present)."""
        with self._guard():
            return [column[0] for column in self.connection.sql(f"SELECT * FROM {self.relation_name} LIMIT 0").description]

    def estimated_bytes(self, rows: int, columns: Sequence[str] | None = None) -> int:
        """What ``rows`` rows of ``columns`` (default: every stored column) take as a pandas DataFrame."""
        if columns is None:
            return rows * ROW_BYTES
        kinds = {f.name: _kind(f.type) for f in self.schema} if self.schema is not None else {}
        per_row = sum(VALUE_BYTES.get(kinds.get(c, "floating"), 8) for c in columns)
        return rows * 2 * per_row  # the Arrow result and the DataFrame, side by side

    def select(self, where_sql: str = "TRUE", columns: Sequence[str] | None = None, *,
               order: Sequence[str] | None = None, what: str = "this slice") -> pd.DataFrame:
        """The rows satisfying ``where_sql`` as a pandas DataFrame (``columns``: default every stored column),
        sorted by ``order`` (default the row key), with a fresh index; refused with a :class:`ProbeError`
        naming the lazy way when its estimated size exceeds :func:`memory_budget`."""
        from probe.core.schema import ROW_KEY

        columns = list(columns) if columns is not None else self.stored_columns
        available = self.view_columns
        unknown = [column for column in columns if column not in available]
        if unknown:
            raise ProbeError(
                f"The rows have no column {', '.join(map(repr, unknown))}. Their columns: {', '.join(available)}."
            )
        order = list(ROW_KEY if order is None else order)
        rows = self.count(where_sql)
        self.require_fits(rows, columns, what)
        ordering = ", ".join(name(c) for c in order)
        return self.frame(
            f"SELECT {', '.join(name(c) for c in columns)} FROM {self.relation_name} WHERE {where_sql}"
            + (f" ORDER BY {ordering}" if ordering else "")
        )

    def require_fits(self, rows: int, columns: Sequence[str] | None, what: str) -> None:
        """Refuse (:class:`ProbeError`) to load ``rows`` rows of ``columns`` when that exceeds the budget."""
        needed, budget = self.estimated_bytes(rows, columns), memory_budget()
        if needed > budget:
            raise ProbeError(
                f"Loading {what} ({rows:,} rows) as a pandas DataFrame would take about {_size(needed)}, more "
                f"than the memory budget of {_size(budget)} ({MEMORY_BUDGET_ENV}). Ask lazily instead: "
                "`run.sql(\"SELECT layer, head, avg(rel_deviation) FROM rows GROUP BY ALL\").df()` (DuckDB over "
                "the part files), `run.query.stats(...)` for exact quantiles, or a smaller slice with "
                "`run.select(space=..., alpha=..., layer=..., head=..., columns=[...])`; or raise the budget, "
                f"e.g. {MEMORY_BUDGET_ENV}=8GB."
            )

    def sample(self, columns: Sequence[str], where_sql: str, rows: int, key: Sequence[str], *,
               total: int | None = None) -> tuple[pd.DataFrame, int]:
        """Every row satisfying ``where_sql`` when at most ``rows`` do, else a deterministic sample of about
        ``rows`` of them (each row kept by the hash of its ``key``); returns the frame and the number of rows
        sampled from (``total``, if known, saves counting them)."""
        total = self.count(where_sql) if total is None else total
        selected = ", ".join(name(c) for c in columns)
        if total <= rows:
            return self.frame(f"SELECT {selected} FROM {self.relation_name} WHERE {where_sql}"), total
        keep = max(1, math.ceil(rows / total * 1_000_000))
        hashed = f"hash({', '.join(name(k) for k in key)}) % 1000000 < {keep}"
        return self.frame(f"SELECT {selected} FROM {self.relation_name} WHERE {both(where_sql, hashed)}"), total

    # ---- derived tables

    def derive(self, table: str, query: str) -> Table:
        """The result of ``query`` written once as a Parquet file in this table's scratch directory (on disk,
        so that it does not hold memory) and read back as a :class:`Table`."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="probe-query-"))
        path = self._scratch / f"{table}.parquet"
        self.execute(f"COPY ({query}) TO '{sql_string(str(path))}' (FORMAT parquet, ROW_GROUP_SIZE 1000000)")
        return Table(self.connection, f"read_parquet('{sql_string(str(path))}')", path)

    def close(self) -> None:
        """Close the connection (when this table opened it) and remove derived tables."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._owns_connection:
            self.connection.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # a derived table's files do not outlive the table
        scratch = getattr(self, "_scratch", None)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _size(n: int) -> str:
    for unit, factor in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} bytes"


def _checked_schema(path: Path, files: list[str]):
    """The Arrow schema of the part files (the first file's, as pyarrow's dataset reads it), checked: the
    needed columns exist and every column has the schema's kind; a clear :class:`ProbeError` otherwise.
    And whether every file has the same columns (read from each footer: a run's parts normally do, but a
    run resumed by another version of probe may not).  ``(None, True)`` for a table without files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from probe.core.schema import DEVIATION_SCHEMA

    if not files:
        return None, True
    try:
        schema = pq.read_schema(files[0])
        same = same_columns(files)
    except (pa.ArrowException, OSError) as error:
        raise ProbeError(f"Cannot read {path} as parquet ({error}). {RUN_HINT}") from None
    missing = [c for c in NEEDED_COLUMNS if c not in schema.names]
    if missing:
        raise ProbeError(
            f"{path} lacks the column(s) {', '.join(missing)} (it has: {', '.join(schema.names) or 'none'}). "
            "The report needs the deviations table written by `probe run`; re-run it with this version of probe."
        )
    wrong = [
        f"{c} is {schema.field(c).type}, expected {DEVIATION_SCHEMA.field(c).type}"
        for c in schema.names
        if c in DEVIATION_SCHEMA.names
        and _kind(schema.field(c).type) not in (_kind(DEVIATION_SCHEMA.field(c).type), "null")
    ]
    if wrong:
        raise ProbeError(f"{path} has columns of the wrong type: {'; '.join(wrong)}. Re-run `probe run`.")
    return schema, same
