"""The speculation phase of a build: the draft head (named, or shipped for these very weights),
the draft sources `speculative_method` asks for, their step costs measured on this device (kept
per process by the weights' identity), and the one controller over them (`Drafter`)."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.build.step_costs import measurement_key, weight_bytes
from engine.config import EngineConfig
from engine.core.step_budget import plausible_step_s
from engine.grammar.structured_output import StructuredOutputs
from engine.kv.manager import KVCacheManager
from engine.spec.answer_corpus import AnswerCorpus
from engine.spec.cost import MEASURED_ROWS, SpecCostModel, measured_shape
from engine.spec.cost import measure as measure_spec_cost
from engine.spec.drafting import Drafter
from engine.spec.eagle import EagleDrafts
from models.eagle.head import EagleHead, load_eagle_head
from models.eagle.shipped import shipped_head_for
from models.llama import LlamaForCausalLM
from models.tokenizer import Tokenizer

log = logging.getLogger("kvserve.engine")

# Step costs measured in this process, by what they depend on: an engine built again on the
# same weights, kernels and pool shape (tests, notebooks) reuses the measurement.
_MEASURED_COSTS: dict[tuple, SpecCostModel] = {}


def load_draft_head(
    config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> EagleHead | None:
    if config.num_speculative_tokens <= 0 or config.speculative_method == "off":
        return None
    if config.speculative_method == "auto" and not config.speculative_model:
        # the shipped head keeps ~0.4 of its first drafts and its catch-up runs every step:
        # measured below 1x beside suffix drafts (bench/speculative.py), so auto takes a head
        # only when one is named
        return None
    if config.speculative_method not in ("auto", "eagle"):
        return None
    if model.spec.group_specs:
        raise ValueError(
            f"an EAGLE draft head over {model.spec.architecture}: its KV groups are declared "
            "whole (compressed attention) and the head reads hidden states its layers do not "
            "hand out; use speculative_method suffix"
        )
    path = config.speculative_model
    if not path:
        # the model, not the flag, decides: a shipped head trained for these very weights
        path = shipped_head_for(model.embed_tokens.weight)
        if path is None:
            raise ValueError(
                "speculative_method eagle needs speculative_model (a draft head directory): "
                "no shipped head was trained for this model (its weights match none)"
            )
    head = load_eagle_head(path, model, dtype, device)
    head.source = path if config.speculative_model else f"{path} (shipped; matched by weights)"
    blocks = head.serve_on_blocks(model)
    if blocks:  # the banner says how the head serves
        head.source += f"; {blocks}"
    log.info(
        "speculative decoding: %s head from %s, k=%d",
        head.cfg.layout,
        head.source,
        config.num_speculative_tokens,
    )
    return head


def build_drafter(
    config: EngineConfig,
    weights_key: tuple,
    model: LlamaForCausalLM,
    head: EagleHead | None,
    backend: AttentionBackend,
    kv: KVCacheManager,
    grammars: StructuredOutputs | None,
    tokenizer: Tokenizer | None,
    device: torch.device,
) -> Drafter | None:
    """The drafter over the sources `speculative_method` asks for, of those this server has
    (None: speculation off)."""
    method, k = config.speculative_method, config.num_speculative_tokens
    if method == "off" or k <= 0:
        return None
    sources = ("grammar", "suffix", "corpus", "eagle") if method == "auto" else (method,)
    corpus = load_answer_corpus(config, model) if "corpus" in sources else None
    have = {"eagle": head is not None, "corpus": corpus is not None}
    sources = tuple(s for s in sources if have.get(s, True))
    log.info("speculative decoding: drafts from %s, at most %d per request", sources, k)
    cost = None
    if config.spec_cost_model:
        cost = _step_costs(config, weights_key, model, head, backend, kv.scratch_blocks, device)
    eagle = None
    if head is not None:
        eagle = EagleDrafts(head, backend, kv.block_size, device, kv.block_ids, grammars)
    encode = None
    if tokenizer is not None:
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return Drafter(sources, k, config.spec_max_verify_rows, cost, encode, eagle, corpus)


def load_answer_corpus(config: EngineConfig, model: LlamaForCausalLM) -> AnswerCorpus | None:
    """The answer corpus named by `speculative_corpus`, else the one beside the head shipped
    for these very weights (matched by their embeddings, so any format of the default model
    gets it); None where there is none and auto asked. Memory-mapped, not read."""
    if config.speculative_corpus == "off":
        if config.speculative_method == "corpus":
            raise ValueError("speculative_method corpus with speculative_corpus off")
        return None
    path = config.speculative_corpus or shipped_head_for(model.embed_tokens.weight)
    if path is None or not AnswerCorpus.present(path):
        if config.speculative_corpus:
            raise ValueError(
                f"speculative_corpus {path}: no answer corpus there (answers.tokens.npy and "
                "answers.suffixes.npy, as tools/answer_corpus.py --out writes them)"
            )
        if config.speculative_method == "corpus":
            raise ValueError(
                "speculative_method corpus: no answer corpus was built for this model (its "
                "weights match no shipped head); name one with speculative_corpus"
            )
        return None
    corpus = AnswerCorpus.load(path)
    log.info("speculative decoding: corpus drafts from %s", corpus.describe())
    return corpus


def _step_costs(
    config: EngineConfig,
    weights_key: tuple,
    model: LlamaForCausalLM,
    head: EagleHead | None,
    backend: AttentionBackend,
    num_blocks: int,
    device: torch.device,
) -> SpecCostModel | None:
    block_size = backend.block_size
    # steps of more rows than a step may verify never enter a choice of k
    rows = tuple(r for r in MEASURED_ROWS if r <= max(2, config.spec_max_verify_rows))
    shape = measured_shape(rows, head is not None, num_blocks, block_size)
    key = measurement_key(weights_key, backend, device, getattr(head, "source", None), shape)
    cost = _MEASURED_COSTS.get(key)
    if cost is None:
        plausible = plausible_step_s(weight_bytes(model))
        for _ in range(2):  # a second time where the CPU was starved while it was timed
            cost = measure_spec_cost(model, head, backend, num_blocks, block_size, device, rows)
            if cost.target_s[0] <= plausible:
                break
        else:
            log.warning(
                "speculation step costs not plausible (one row %.0f ms, over this model's "
                "roofline floor of %.0f ms: the CPU was busy while they were timed): drafts "
                "sized by spec_max_verify_rows alone",
                1e3 * cost.target_s[0],
                1e3 * plausible,
            )
            return None
        _MEASURED_COSTS[key] = cost
    log.info("speculation step costs (rows: target/draft): %s", cost.table())
    return cost
