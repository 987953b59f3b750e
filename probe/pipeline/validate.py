"""Every check that can run before anything expensive, in the order a run meets them.

:func:`check_run` runs before probe loads the model's weights or creates the run directory, so a
rejected run costs seconds and leaves nothing on disk.  Each check raises a :class:`ProbeError` that
says what is wrong and what to do:

1. **options**: each alpha finite and > 0 (no repeats), tolerances finite and > 0, a known dtype, a
   device that exists here (cpu; cuda[:N] and mps only where available; never meta), batch size,
   samples and max length >= 1, known spaces and init, a memory budget > 0;
2. **output**: ``--out`` can hold a new run directory (a temporary file is created and removed in it,
   or in its nearest existing parent; ``--out`` itself is not created);
3. **data**: readable, not empty, the text column exists and holds text (:mod:`probe.capture.data` names the
   file, the line or row and what was found);
4. **model**: a local directory (or the cached copy of a hub id) has a readable config.json naming an
   architecture that has an adapter (which supports the chosen spaces), weights that are not truncated
   (not needed with ``--init random``), and tokenizer files unless ``--tokenizer`` is given; the
   tokenizer has a vocabulary; ``--target-column`` only for a model with a decoder input (an
   encoder-decoder), read from the config before any weights load.  A hub id needs the Hub, probed
   once and quickly (:mod:`probe.capture.hub`);
5. **the vocabulary**: the tokenizer's largest id within the model's embedding rows; **max length**:
   ``--max-length`` at most the model's position limit (an error that says the limit; probe never changes
   a setting behind the user's back) and at least its special tokens;
6. **options that do not apply** to the chosen input: ``--split``/``--config`` on a local file,
   ``--column``/``--split``/``--config`` with the embedded corpus, ``--revision`` with a local
   model directory;
7. **unknown tokens**: the tokenizer turns at most 10% of the texts' tokens into its unknown token, unless
   ``--allow-unknown-tokens`` (:mod:`probe.capture.tokens`; every text is tokenized once for it).

Messages name options as the caller spells them: ``--alpha`` on the command line, ``alpha=`` in Python
(:mod:`probe.core.spelling`).

``--format`` is checked by the CLI (:func:`check_report_formats`) before the run when ``--report``
is given.  What only loading the weights can tell (tensors whose shapes do not fit the config, weights
the checkpoint lacks) is checked while loading (:func:`probe.capture.checkpoint.from_pretrained_checked`), still
before the run directory exists.
"""

from __future__ import annotations

import json
import math
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from probe.capture.data import DatasetSpec, Texts, load_texts
from probe.capture.hub import (
    cached_snapshot,
    check_hub_name,
    hub_reachable,
    no_connection,
)
from probe.capture.tokens import check_unknown_tokens, unknown_tokens
from probe.capture.truncation import cut_texts, kept_characters
from probe.core.arguments import parse_keep
from probe.core.config import (
    ATTN_IMPLEMENTATIONS,
    DTYPE_NAMES,
    INITS,
    INTERVENTION_MODES,
    INTERVENTION_SUBSTITUTES,
    SPACES,
)
from probe.core.destination import check_destination
from probe.core.environment import check_environment
from probe.core.errors import ProbeError
from probe.core.spelling import option

#: Files that hold a model's weights (one of them is needed), as save_pretrained writes them.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: Files that hold a tokenizer's vocabulary (one of them is needed).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")
#: config.json entries that bound the sequence length (absolute position tables).
POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length")
#: A tokenizer's model_max_length at or above this means "no limit" (transformers' placeholder is 1e30).
NO_LIMIT = 10**9

@dataclass
class Checked:
    """What the checks found and the run needs: the texts (read once, here) and the settings with their
    defaults resolved (the adapter's default space, the fidelity tolerance of the model's dtype)."""

    texts: Texts
    load_data_s: float
    config: object
    unknown_tokens: dict  # the tokenizer's unknown tokens among the texts' (probe.capture.tokens.unknown_tokens)


def check_run(config) -> Checked:
    """Run every up-front check on a :class:`probe.pipeline.runner.RunConfig`, in the order of this module's
    docstring; return the texts and the settings with their defaults resolved.  Nothing is written and
    no weights are loaded."""
    check_options(config)
    check_output(Path(config.out))
    started = time.perf_counter()
    texts = load_texts(config.dataset, kept_characters(config.max_length))  # a long line is read only so far
    load_data_s = time.perf_counter() - started
    model_config, tokenizer, spaces = check_model(config)
    check_vocabulary(config, model_config, tokenizer)
    check_max_length(config, model_config, tokenizer)
    check_not_applicable(config)
    texts = cut_texts(texts, tokenizer, config.max_length)  # a long text is tokenized only as far as it is kept
    unknown = unknown_tokens(tokenizer, texts.texts, config.max_length)
    check_unknown_tokens(unknown, config.model, config.allow_unknown_tokens)
    from dataclasses import replace

    from probe.batch.problems import FIDELITY_TOLERANCE

    tolerance = config.fidelity_tolerance
    resolved = replace(config, spaces=spaces, fidelity_tolerance=FIDELITY_TOLERANCE[config.dtype] if tolerance is None
                       else tolerance)
    return Checked(texts=texts, load_data_s=load_data_s, config=resolved, unknown_tokens=unknown)


# --------------------------------------------------------------------------------------------------
# 1. options


def check_options(config) -> None:
    """Values of the run's options on their own (no file is looked at, and nothing heavy is imported:
    torch loads only to check a device other than auto or cpu), and probe's environment variables."""
    check_environment()

    if not config.alphas:
        raise ProbeError(f"{option('alpha')} needs at least one value.")
    for alpha in config.alphas:
        if not math.isfinite(alpha) or alpha <= 0:
            raise ProbeError(
                f"{option('alpha')} must be a finite number > 0 (the strength of the inference problem), got {alpha}."
            )
    if len(set(config.alphas)) != len(config.alphas):
        raise ProbeError(
            f"{option('alpha')} lists a value twice ({', '.join(map(str, config.alphas))}); list each once.")
    # the fidelity tolerance (None: by the model's dtype), and the solver's rtol (a setting, not an option)
    for name, value in ((option("fidelity_tolerance"), config.fidelity_tolerance), ("rtol", config.rtol)):
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ProbeError(f"{name} must be a finite number > 0, got {value}.")
    if config.dtype not in DTYPE_NAMES:
        raise ProbeError(f"Unknown {option('dtype', config.dtype)}. Choose one of: {', '.join(DTYPE_NAMES)}.")
    if config.device not in ("auto", "cpu"):
        from probe.capture.loading import resolve_device

        resolve_device(config.device)
    for name, value in (("batch_size", config.batch_size), ("max_length", config.max_length)):
        if value < 1:
            raise ProbeError(f"{option(name)} must be at least 1, got {value}.")
    if config.dataset.samples is not None and config.dataset.samples < 1:
        raise ProbeError(f"{option('samples')} must be at least 1, got {config.dataset.samples}.")
    if config.spaces is not None and not config.spaces:
        raise ProbeError(f"{option('space')} needs at least one of: {', '.join(SPACES)}.")
    unknown = [space for space in config.spaces or () if space not in SPACES]
    if unknown:
        raise ProbeError(
            f"Unknown {option('space', ','.join(unknown))}. Choose from: {', '.join(SPACES)} (comma separated).")
    if config.spaces is not None and len(set(config.spaces)) != len(config.spaces):
        raise ProbeError(f"{option('space')} lists a space twice ({', '.join(config.spaces)}); list each once.")
    if config.init not in INITS:
        raise ProbeError(f"Unknown {option('init', config.init)}. Choose {' or '.join(INITS)}.")
    if config.max_memory_bytes is not None and config.max_memory_bytes < 1:
        raise ProbeError(f"{option('max_memory')} must be more than 0 bytes, got {config.max_memory_bytes}.")
    if config.threads is not None and config.threads < 1:
        raise ProbeError(f"{option('threads')} must be at least 1, got {config.threads}.")
    check_intervention_options(config)
    parse_keep(getattr(config, "keep", "rows"))
    implementation = getattr(config, "attn_implementation", "eager")
    if implementation not in ATTN_IMPLEMENTATIONS:
        raise ProbeError(
            f"Unknown {option('attn_implementation', implementation)}. Choose eager (the model's eager attention, "
            "its probabilities checked) or sdpa (its fast attention, which never forms the probabilities: for long "
            "contexts; its output checked).")
    if implementation == "sdpa" and config.intervene:
        raise ProbeError(
            f"{option('intervene')} puts other attention weights into the model's eager attention; "
            f"{option('attn_implementation', 'sdpa')} runs its fast attention instead. Remove one of them.")


def check_intervention_options(config) -> None:
    """``--intervene`` and ``--intervene-modes`` (probe.interventions): known names, each once; and no selection
    with ``--intervene``, which substitutes whole sites (every head and query) into the forward pass."""
    intervene = tuple(getattr(config, "intervene", ()) or ())
    if intervene and config.selects:
        from probe.capture.selection import describe_config

        raise ProbeError(
            f"{option('intervene')} puts each site's exact posterior into the forward pass for every head and query, "
            f"so it measures the whole model, but this run selects part of it ({describe_config(config)}). Remove "
            f"{option('intervene')}, or the selection ({option('layers')}, {option('heads')}, "
            f"{option('attention_types')}, {option('queries')})."
        )
    modes = tuple(getattr(config, "intervene_modes", INTERVENTION_MODES) or ())
    for name, values, choices in (("intervene", intervene, INTERVENTION_SUBSTITUTES),
                                  ("intervene_modes", modes, INTERVENTION_MODES)):
        unknown = [value for value in values if value not in choices]
        if unknown:
            raise ProbeError(
                f"Unknown {option(name, ','.join(unknown))}. Choose among {', '.join(choices)} "
                f"(comma separated), e.g. {option(name, ','.join(choices[:2]))}."
            )
        if len(set(values)) != len(values):
            raise ProbeError(f"{option(name)} lists a value twice ({', '.join(values)}); list each once.")
    if not modes:
        raise ProbeError(f"{option('intervene_modes')} needs at least one of: {', '.join(INTERVENTION_MODES)}.")


def check_report_formats(formats: str) -> list[str]:
    """The figure formats of ``--format`` (checked by the report's own rule), before any work."""
    from probe.report import check_formats

    return check_formats(formats.split(","))


# --------------------------------------------------------------------------------------------------
# 2. output


#: the room ``--out`` must have before a run starts (a few batches' part files; a full disk later is exit 74)
RUN_MIN_FREE_BYTES = 64 << 10


def check_output(out: Path) -> None:
    """``out`` is, or can become, a folder in which probe can create a run directory, with room
    (:func:`probe.core.destination.check_destination`, the check every writer makes)."""
    check_destination(out, "out", room=RUN_MIN_FREE_BYTES)


# --------------------------------------------------------------------------------------------------
# 4. model


def _local_or_cached(name: str, revision: str | None, what: str, marker: str) -> Path | None:
    """The directory holding ``name``'s files (``what``: the option's parameter name, model or tokenizer):
    itself when local, its cached snapshot when the Hub is closed; None for a hub id that will be downloaded."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ProbeError(f"The {what} '{name}' ({option(what)}) is a file; pass the directory that holds its files.")
        return path
    check_hub_name(name, what, option(what), "bert-base-uncased")
    if hub_reachable():
        return None
    snapshot = cached_snapshot(name, revision, marker)
    if snapshot is None:
        raise no_connection(name, what, "directory")
    return snapshot


def check_weight_files(directory: Path, name: str) -> None:
    """One of :data:`WEIGHT_FILES` exists, every shard of an index exists, and no file is truncated
    (safetensors headers are parsed; zip-format torch files must have their central directory)."""
    present = [directory / f for f in WEIGHT_FILES if (directory / f).exists()]
    if not present:
        raise ProbeError(
            f"The model directory '{name}' has no weights: none of {', '.join(WEIGHT_FILES)}. "
            "Save the model with save_pretrained (or copy its weights file) into it."
        )
    index = next((f for f in present if f.name.endswith(".index.json")), None)
    if index is not None and len(present) == 1:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as error:
            raise ProbeError(f"The weights index '{index}' is not a valid index file ({error}).") from None
        missing = [shard for shard in shards if not (directory / shard).exists()]
        if missing:
            raise ProbeError(
                f"The model directory '{name}' lacks {len(missing)} of the {len(shards)} weight shards its index "
                f"lists, e.g. '{missing[0]}'. Copy or download the model again."
            )
        files = [directory / shard for shard in shards]
    else:
        files = [f for f in present if not f.name.endswith(".index.json")]
    for file in files:
        problem = _weights_file_problem(file)
        if problem:
            raise ProbeError(
                f"The weights file '{file}' is {problem}: an interrupted download or copy? Copy or download the model again."
            )


def _weights_file_problem(file: Path) -> str | None:
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(file), "pt"):
                pass
        except SafetensorError as error:
            return f"corrupt or incomplete ({error})"
        return None
    with file.open("rb") as handle:
        zipped = handle.read(2) == b"PK"  # torch.save's zip format (older files are plain pickles)
    if zipped and not zipfile.is_zipfile(file):
        return "incomplete (its zip directory is missing)"
    return None


def check_tokenizer_files(directory: Path, name: str, given: str) -> None:
    if not any((directory / f).exists() for f in TOKENIZER_FILES):
        raise ProbeError(
            f"'{name}' has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}{given}). Without them every "
            "word would become the unknown token. Save the tokenizer beside the model (tokenizer.save_pretrained), "
            f"or pass the directory that holds it with {option('tokenizer', 'PATH')}."
        )


def check_model(config):
    """The model's files and config, and its tokenizer; returns ``(transformers config, tokenizer, spaces)``
    with the spaces asked for (or the adapter's default)."""
    from probe.capture.adapters import adapter_for
    from probe.capture.loading import load_config, load_tokenizer

    directory = _local_or_cached(config.model, config.revision, "model", "config.json")
    if directory is not None and not (directory / "config.json").exists():
        raise ProbeError(
            f"'{config.model}' has no config.json: it is not a Hugging Face model directory. "
            "Pass a directory written by save_pretrained, or a hub model id."
        )
    model_config = load_config(config.model, config.revision)
    adapter = adapter_for(model_config.model_type)  # an architecture without adapter fails before anything else
    adapter.model_class(model_config)  # the adapter may refuse a checkpoint (an encoder-only T5, for example)
    check_family_options(config, model_config, adapter)
    from probe.capture.selection import resolve as resolve_selection

    resolve_selection(config, adapter.stacks(model_config))  # --layers, --heads, --attention-types against the model
    spaces = tuple(config.spaces or adapter.spaces[:1])  # None: the adapter's default (rotary models: key)
    unsupported = [space for space in spaces if space not in adapter.spaces]
    if unsupported:
        raise ProbeError(
            f"{model_config.model_type} supports the space(s) {', '.join(adapter.spaces)} only, not "
            f"{', '.join(unsupported)} (rotary models have no hidden-space parameterisation). Pass "
            f"{option('space', ','.join(adapter.spaces))}."
        )
    if directory is not None:
        if config.init != "random":
            check_weight_files(directory, config.model)
        if config.tokenizer is None:
            check_tokenizer_files(directory, config.model, "")
    if config.tokenizer is not None:
        tokenizer_directory = _local_or_cached(config.tokenizer, None, "tokenizer", "tokenizer_config.json")
        if tokenizer_directory is not None:
            check_tokenizer_files(tokenizer_directory, config.tokenizer, f"; given with {option('tokenizer')}")
    tokenizer = load_tokenizer(config.tokenizer or config.model, None if config.tokenizer else config.revision)
    return model_config, tokenizer, spaces


def check_family_options(config, model_config, adapter) -> None:
    """Options that only one family of models reads: ``--target-column`` feeds the decoder of an
    encoder-decoder (teacher forcing); an encoder-only or decoder-only model would ignore it."""
    if getattr(config, "intervene", ()):
        from probe.capture.adapters.generic import InterfaceAdapter

        if not isinstance(adapter, InterfaceAdapter):
            raise ProbeError(
                f"{option('intervene')} needs a model whose attention probe can substitute, but '{config.model}' "
                f"({model_config.model_type}) is captured with hooks on its family's own attention code, which "
                "offers no point to put other weights in. Interventions work for the families that compute "
                "attention through transformers' attention interface (BERT, T5, BART, GPT-2, Llama, ...): "
                f"remove {option('intervene')}, or run one of those."
            )
    if getattr(config, "attn_implementation", "eager") == "sdpa":
        from probe.capture.adapters.generic import InterfaceAdapter

        if not isinstance(adapter, InterfaceAdapter):
            raise ProbeError(
                f"{option('attn_implementation', 'sdpa')} runs the model's fast attention through transformers' "
                f"attention interface, but '{config.model}' ({model_config.model_type}) is captured with hooks on "
                "its family's own attention code, which computes the eager probabilities: probe measures this "
                f"family with its eager attention, so remove {option('attn_implementation')}.")
    if config.dataset.target_column is not None and "cross" not in adapter.attention_types:
        kind = "decoder-only" if "causal_self" in adapter.attention_types else "encoder-only"
        raise ProbeError(
            f"{option('target_column')} applies to encoder-decoder models (their decoder reads the targets), but "
            f"'{config.model}' ({model_config.model_type}) is {kind}: it would ignore the column. Remove "
            f"{option('target_column')}, or run an encoder-decoder model (t5, bart, ...)."
        )


# --------------------------------------------------------------------------------------------------
# 5. max length


def position_limit(model_config, tokenizer) -> tuple[int, str] | None:
    """The longest input the model takes, and where that limit comes from (None: no limit)."""
    limits = []
    for attribute in POSITION_LIMITS:
        value = getattr(model_config, attribute, None)
        if isinstance(value, int) and value > 0:
            limits.append((value, f"its position table has {value} entries ({attribute} in config.json)"))
            break
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < NO_LIMIT:
        limits.append((value, f"its tokenizer's model_max_length is {value}"))
    return min(limits) if limits else None


def check_max_length(config, model_config, tokenizer) -> None:
    limit = position_limit(model_config, tokenizer)
    if limit is not None and config.max_length > limit[0]:
        raise ProbeError(
            f"{option('max_length', config.max_length)} is more than '{config.model}' takes: {limit[1]}. "
            f"Use {option('max_length', limit[0])} or less."
        )
    special = len(tokenizer("")["input_ids"])  # tokens added to every text ([CLS], [SEP], </s>, ...)
    if config.max_length < special:
        raise ProbeError(
            f"{option('max_length', config.max_length)} is too small for this tokenizer: it adds {special} special "
            f"tokens to every text, which are never truncated. Use a larger {option('max_length')}."
        )


def check_vocabulary(config, model_config, tokenizer) -> None:
    """Every id the tokenizer can produce has a row in the model's input embeddings: the largest id (its
    vocabulary with the added tokens) is below ``vocab_size`` of config.json, which the checkpoint's
    embedding matrix must match when the weights load.  A tokenizer of another model would otherwise
    fail mid-run, at the first text with a word beyond the table."""
    rows = getattr(model_config, "vocab_size", None)
    if not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
        return  # a config that does not say (the weights' shapes are checked when they load)
    try:
        ids = max(tokenizer.get_vocab().values(), default=-1) + 1
    except (AttributeError, NotImplementedError, TypeError):
        ids = 0
    ids = max(ids, len(tokenizer))
    if ids > rows:
        given = f"the tokenizer given with {option('tokenizer')}" if config.tokenizer else "its tokenizer"
        raise ProbeError(
            f"The tokenizer does not fit '{config.model}': {given} produces ids up to {ids - 1:,} ({ids:,} tokens), "
            f"but the model's input embeddings have {rows:,} rows (vocab_size in config.json), so any text with a "
            "token beyond them would fail. Use the tokenizer the model was trained with "
            f"({option('tokenizer', 'PATH')} names another one)."
        )


# --------------------------------------------------------------------------------------------------
# 6. options that do not apply


def check_not_applicable(config) -> None:
    spec: DatasetSpec = config.dataset
    if spec.name is None:
        given = [option(name) for name, value in (("column", spec.column), ("split", spec.split),
                                                  ("config", spec.config)) if value is not None]
        if given:
            raise ProbeError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to {option('dataset')}, but no "
                f"{option('dataset')} is given: the embedded corpus has one column of texts and no splits or "
                f"configurations. Remove the option or add {option('dataset')}."
            )
    elif spec.local_path is not None:
        given = [option(name) for name, value in (("split", spec.split), ("config", spec.config)) if value is not None]
        if given:
            raise ProbeError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to hub datasets, but '{spec.name}' "
                "is a local file: it has no splits or configurations. Remove the option (or split the file yourself)."
            )
    if config.revision is not None and Path(config.model).expanduser().exists():
        raise ProbeError(
            f"{option('revision')} applies to hub ids, but '{config.model}' is a local directory (it holds one "
            f"version). Remove {option('revision')}."
        )

