"""What a job does with the store it is pointed at: the plan to follow and the shards left.

A store that holds a plan is resumed with *that* plan when the corpus bytes, the
tokenizer and the settings are the ones it was made with -- checked by hashing the
corpus and reading the tokenizer (`planning.plan_inputs`), not by tokenizing the
corpus again (hours at full size). Where the files lie does not matter: a copied or
moved tree resumes. Anything else differing is refused, naming what differs."""

from __future__ import annotations

from transformers import AutoTokenizer

from store_schema import Plan, StoreReader
from store_schema.plan import PlanSettings
from store_schema.stores import StoreBackend

from ..corpus import open_corpus
from ..errors import ExtractError, PlanError
from ..jobs.driver import Planned
from .config import JobConfig
from .planning import plan_differences, plan_inputs


def plan_and_resume(config: JobConfig, store_path: StoreBackend, planner, log) -> tuple[Planned, StoreReader | None]:
    """The job's plan and the shards left, and the store it resumes (None: its root is
    to be created -- new, overwritten, or planned only). `planner()` makes a plan from
    scratch (`extract.extraction.job.plan_job`), called only when the store holds none
    to reuse."""
    store = _existing_store(config, store_path)
    stored = store.plan() if store is not None else _plan_without_root(config, store_path)
    if store is not None and stored is None and store.committed_shards():
        raise ExtractError(f"{store_path} has committed shards but no plan; use --overwrite or a new store")
    if stored is not None:
        _check_same_plan(config, store_path, stored)
        log(
            f"reusing the store's plan ({stored.num_samples} samples in {len(stored.shards)} shards): same corpus "
            "bytes, tokenizer and settings, nothing re-tokenized"
        )
        plan, reused = stored, True
    else:
        plan, reused = planner(), False
    everything = [s.name for s in plan.shards]
    committed = set(store.committed_shards()) if store is not None else set()
    pending = [name for name in everything if name not in committed]
    return Planned(plan, reused, pending), store


def _existing_store(config: JobConfig, store_path) -> StoreReader | None:
    """The store to resume; None without a root yet (at most a plan committed before the
    workers started: `_plan_without_root`)."""
    if config.overwrite:
        return None
    return store_path.open_existing()


def _plan_without_root(config: JobConfig, store_path) -> Plan | None:
    """The plan a job committed before its workers started, in a store whose root
    they never got to create (no GPU, a failed start, Ctrl-C)."""
    if config.overwrite:
        return None
    return store_path.read_plan()


def _check_same_plan(config: JobConfig, store_path, stored: Plan) -> None:
    """Refuse unless this job's corpus, tokenizer and settings are the stored plan's."""
    tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer_path))
    corpus = open_corpus(config.corpus)
    settings = config.plan_settings
    if config.plan_settings_given is not None:
        settings = PlanSettings.from_json(stored.settings).overridden(settings, config.plan_settings_given)
    wanted = plan_inputs(corpus, config.corpus, tokenizer, config.tokenizer_path, settings)
    differences = plan_differences(stored.settings, wanted)
    if differences:
        raise ExtractError(
            f"{store_path} holds a different plan ({', '.join(differences[:6])}); rerun with the settings it was "
            "made with, use a new store, or pass --overwrite to start over"
        )
    if config.strict and stored.quarantined:
        first = stored.quarantined[0]
        raise PlanError(first.record_index, first.reason, first.detail, corpus.where(first.record_index))
