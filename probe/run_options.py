"""The options of a run on the command line, declared once: ``probe run`` takes every one, ``probe series`` every
one that means the same for each checkpoint (all but :data:`PER_RUN`, which a series sets for each run itself).

A command declares its own arguments and options and adds these with :func:`with_run_options`: its signature,
which typer reads, gains the run options as keyword-only parameters, and the command receives them in
``**options`` under :func:`probe.run`'s parameter names, ready to pass on.  So the two commands cannot drift
apart: an option added here is an option of both.  Nothing heavy is imported.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Callable, Optional

import typer


def _option(name: str, annotation, default, *flags: str, **declaration) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, **declaration))


#: the run options, in the order ``--help`` lists them; each named as :func:`probe.run`'s parameter
RUN_OPTIONS: tuple[inspect.Parameter, ...] = (
    _option("dataset", Optional[str], None, metavar="FILE|NAME",
            help="Hub dataset name or a local .txt/.jsonl/.csv/.parquet file [default: the embedded corpus]."),
    _option("config", Optional[str], None, metavar="NAME", help="Hub dataset configuration (e.g. wikitext-2-raw-v1)."),
    _option("split", Optional[str], None, metavar="NAME", help="Hub dataset split [default: train]."),
    _option("column", Optional[str], None, metavar="NAME", help="Column holding the texts [default: text]."),
    _option("target_column", Optional[str], None, metavar="NAME",
            help="Column holding decoder targets, for encoder-decoder models (refused for others) [default: the text "
            "itself]."),
    _option("samples", Optional[str], None, metavar="N|random:N",
            help="N: the first N non-empty texts; random:N: N of them drawn at random, seeded by --seed (the same "
            "texts on every run and resume with that seed) [default: every text]."),
    _option("max_length", int, 128, metavar="N", help="Truncate texts to this many tokens (at most the model's limit)."),
    _option("batch_size", int, 8, metavar="N", help="Examples per forward pass."),
    _option("alpha", str, "1", metavar="A[,A...]",
            help="Strength alpha of the inference problem; a comma-separated list (0.25,0.5,1,2,4) solves each from one "
            "capture."),
    _option("space", Optional[str], None, metavar="SPACE[,SPACE]",
            help="Parameterisation(s), comma separated: hidden (t=x/sqrt(d'), z=c*W_k^T*q) and/or key (t=k/sqrt(d'), "
            "z=c*q) [default: hidden; key for rotary models, which have no hidden space]."),
    _option("layers", Optional[str], None, metavar="L[,L...]",
            help="Measure only these layers, within each attention type's stack: indices and ranges a-b, negative from "
            "the end (0,5,-1 or 2-4) [default: all]."),
    _option("heads", Optional[str], None, metavar="H[,H...]",
            help="Measure only these query heads, with the syntax of --layers [default: all]."),
    _option("attention_types", Optional[str], None, "--attention-types", metavar="T[,T...]",
            help="Measure only these attention types, e.g. cross alone on a T5 (self, causal_self, encoder_self, "
            "decoder_self, cross) [default: all]."),
    _option("queries", str, "all", metavar="RULE",
            help="Which query positions of each text to measure: all; last, its last real token; every:K, positions "
            "0, K, 2K, ...; sample:N, N positions per text drawn with --seed, the same at every site and head. Only "
            "what is selected is captured, solved and written."),
    _option("keep", str, "rows", "--keep", metavar="rows|aggregates|sample:N",
            help="What the run keeps: every row; aggregates (mergeable statistics computed where the rows are: what "
            "the report reads, at a fixed size); or sample:N (the aggregates and a seeded uniform sample of N rows) "
            "(docs: keep modes)."),
    _option("attn_implementation", str, "eager", "--attn-implementation", metavar="eager|sdpa",
            help="The attention the model runs while it is measured: eager (its probabilities formed and checked) or "
            "sdpa (its fast attention: no (heads, tokens, tokens) probabilities, for long contexts with --queries; "
            "its output checked instead) (docs: large models and long contexts)."),
    _option("tokenizer", Optional[str], None, metavar="PATH|ID",
            help="Directory (or hub id) of the tokenizer, when it is not beside the model."),
    _option("max_memory", Optional[str], None, metavar="SIZE",
            help="Memory budget for the problems held at once and the solver's working set, e.g. 4GB, 512MiB or 2G "
            "(the model and a batch's forward pass come on top: docs, speed and memory)."),
    _option("threads", Optional[int], None, metavar="N",
            help="CPU threads for the model and the solver [default: torch's, one per core; idle threads sleep "
            "instead of spinning (OMP_WAIT_POLICY=PASSIVE unless set)]."),
    _option("out", Path, Path("runs"), metavar="DIR", help="Parent directory of the run directories."),
    _option("device", str, "auto", "--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps."),
    _option("dtype", str, "float32", "--dtype", metavar="DTYPE",
            help="Model dtype: float32, bfloat16, float16 or float64 (the solver always works in float64)."),
    _option("seed", int, 0, metavar="N", help="Random seed (random init, sampled query positions; recorded in the "
            "manifest)."),
    _option("fidelity_tolerance", Optional[float], None, metavar="TOL",
            help="Max abs error allowed between reconstructed and eager attention (with --attn-implementation sdpa: "
            "between the output rebuilt from it and the model's, relative to the largest value) [default: by "
            "--dtype: float64 1e-6, float32 1e-5, float16 1e-2, bfloat16 5e-2]."),
    _option("intervene", Optional[str], None, metavar="SUB[,SUB...]",
            help="Also put substitutes for the attention weights into the forward pass and measure the model's outputs "
            "(docs/interventions.md): exact (the exact posterior p*), second-order, null (a random change of the same "
            "size), model (its own weights: the identity check); records go to interventions.parquet/ beside the rows "
            "[default: off]."),
    _option("intervene_modes", Optional[str], None, metavar="MODE[,MODE]",
            help="With --intervene: per-site (each attention site substituted on its own) and/or whole (every site at "
            "once, solved in order) [default: per-site,whole]."),
    _option("allow_unknown_tokens", bool, False, "--allow-unknown-tokens",
            help="Run although the tokenizer turns more than 10% of the texts' tokens into its unknown token (refused "
            "otherwise: the tokenizer does not know the texts). The share is recorded either way."),
    _option("revision", Optional[str], None, metavar="REV", help="Model revision (hub branch, tag or commit)."),
    _option("init", str, "pretrained", "--init", metavar="INIT",
            help="pretrained, or random: the same architecture with fresh weights (seeded by --seed), the control for "
            "what training did; its run is named MODEL-random."),
    _option("step", Optional[int], None, "--step", metavar="N",
            help="The training step of the checkpoint, recorded in the manifest: `probe compare` draws runs that each "
            "have one against it (docs: attention across training)."),
    _option("name", Optional[str], None, "--name", metavar="NAME",
            help="The run's name: its directory is NAME-<time> and its report's title NAME [default: the model's real "
            "name, from its files; MODEL-random for --init random]."),
)
#: the run options a series sets for each of its runs (revision, init, step: from the checkpoint; the run's name
#: from the series' name), which `probe series` therefore does not take as run options
PER_RUN = ("revision", "init", "step", "name")


def with_run_options(*, leave_out: tuple[str, ...] = ()) -> Callable:
    """Add :data:`RUN_OPTIONS` (but ``leave_out``) to a typer command whose last parameter is ``**options``:
    they follow its own parameters in its signature and ``--help``, and reach it in ``options`` by name."""

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        names = {p.name for p in own}
        added = [p for p in RUN_OPTIONS if p.name not in leave_out and p.name not in names]

        @functools.wraps(command)
        def with_options(*args, **kwargs):
            return command(*args, **kwargs)

        del with_options.__wrapped__  # typer reads __signature__, not the wrapped function's
        with_options.__signature__ = signature.replace(parameters=own + added)
        return with_options

    return decorate


def run_option_names(*, leave_out: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names of :data:`RUN_OPTIONS` but ``leave_out``."""
    return tuple(p.name for p in RUN_OPTIONS if p.name not in leave_out)
