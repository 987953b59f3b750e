"""What a run segment works on (:class:`Job`): the settings, the loaded model, the texts and the batch plan,
longest texts first."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from probe.batch.columns import RowContext
from probe.capture.adapters.interface import IMPLEMENTATIONS, set_attention
from probe.capture.data import DatasetSpec, Texts, load_texts
from probe.capture.loading import LoadedModel, device_name, load_model
from probe.capture.selection import Selection
from probe.capture.selection import resolve as resolve_selection
from probe.capture.truncation import cut_texts, kept_characters
from probe.core import naming
from probe.core.config import RunConfig
from probe.core.errors import ProbeError
from probe.pipeline import distributed


@dataclass
class Job:
    """What a run segment works on: its settings, the loaded model, the texts and the batch plan."""

    config: RunConfig
    loaded: LoadedModel
    texts: Texts
    batches: list[list[int]]  # dataset positions of each batch, in the run's batch order
    lengths: list[int]  # token count of each text
    device: torch.device
    context: RowContext  # what rows need beyond sites and solutions (token texts, cached over the run)
    timings: dict
    started: float  # time.perf_counter() when the segment started loading
    selection: Selection  # what the run measures (probe.capture.selection), resolved against the loaded model
    #: --keep sample:N: the N smallest row hashes this process has seen (probe.batch.aggregates.SampleBound)
    sample_bound: object = None


#: texts tokenized at once while the batches are planned (their lengths are kept, not their tokens, so
#: that planning holds a few thousand texts' tokens whatever the number of texts)
PLAN_CHUNK = 4096


def plan_batches(loaded: LoadedModel, texts: Texts, batch_size: int, max_length: int):
    """Batches of dataset positions, longest first (less padding; memory problems show at once)."""
    lengths = []
    for start in range(0, len(texts.texts), PLAN_CHUNK):
        chunk = texts.texts[start : start + PLAN_CHUNK]
        lengths += [len(ids) for ids in loaded.tokenizer(chunk, truncation=True, max_length=max_length)["input_ids"]]
    if max(lengths) > max_length:
        raise ProbeError(
            f"--max-length {max_length} is too small for this tokenizer: it produced {max(lengths)} tokens "
            "(special tokens are never truncated). Use a larger --max-length."
        )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)], lengths


def prepare(
    config: RunConfig, device: str, model_location: str | None = None, dataset: DatasetSpec | None = None,
    texts: Texts | None = None, loaded: LoadedModel | None = None,
) -> Job:
    """Load the model (from ``model_location``, default ``config.model``; ``loaded``: one already in memory,
    taken as it is) onto ``device`` and the texts (``texts`` when already read, else from ``dataset``, default
    ``config.dataset``); plan the batches."""
    torch.manual_seed(config.seed)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    started = time.perf_counter()
    if loaded is None:
        say(config, f"loading {naming.model_name(config.model)} ({config.init} weights, {config.dtype}) onto "
                    f"{device_name(device)}")
        loaded = load_model(
            model_location or config.model, revision=config.revision, dtype=config.dtype, device=device,
            init=config.init, seed=config.seed, tokenizer=config.tokenizer,
        )
    attention = IMPLEMENTATIONS[config.attn_implementation]  # the run's attention, from here to its end (a model
    if loaded.model.config._attn_implementation != attention:  # in memory is given its own back by measuring())
        set_attention(loaded.model, attention)
    unsupported = [space for space in config.spaces if space not in loaded.adapter.spaces]
    if unsupported:
        raise ProbeError(
            f"{loaded.info['model_type']} supports the space(s) {', '.join(loaded.adapter.spaces)} only, not "
            f"{', '.join(unsupported)} (rotary models have no hidden-space parameterisation). Pass "
            f"--space {','.join(loaded.adapter.spaces)}."
        )
    if config.intervene:  # the model with its LM head (rows and interventions alike), refused before the run
        from probe.interventions import require_intervention, with_lm_head

        loaded = with_lm_head(loaded)
        require_intervention(loaded)
    loaded_at = time.perf_counter()
    if texts is None:  # a long line is read only as far as --max-length needs
        texts = load_texts(dataset or config.dataset, kept_characters(config.max_length))
    texts = cut_texts(texts, loaded.tokenizer, config.max_length)  # tokenized only as far as it is kept
    timings = {"load_model_s": loaded_at - started, "load_data_s": time.perf_counter() - loaded_at}
    say(config, f"planning the batches of {len(texts.texts):,} texts (tokenizing them)")
    batches, lengths = plan_batches(loaded, texts, config.batch_size, config.max_length)
    device = next(loaded.model.parameters()).device
    context = RowContext(
        example_ids=[], special_ids=frozenset(loaded.tokenizer.all_special_ids),
        token_text={}, tokenizer=loaded.tokenizer,
    )
    selection = resolve_selection(config, loaded.adapter.stacks(loaded.model.config))
    return Job(config, loaded, texts, batches, lengths, device, context, timings, started, selection)


def say(config: RunConfig, message: str) -> None:
    """What the run is doing, on stderr, before the progress bar starts (not with --no-progress; rank 0
    speaks for the run)."""
    if config.progress and distributed.Ranks.from_environment().main:
        import sys

        print(f"probe: {message}", file=sys.stderr, flush=True)

