"""Corpus drafts (engine/spec/answer_corpus.py): the suffix array is the sorted suffixes, a
match continues where most of the corpus's occurrences agree and never across an answer, and
drafts from a corpus of the model's own answers are lossless and mostly kept."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.spec.answer_corpus import SEPARATOR, AnswerCorpus, build_suffix_array, write_corpus
from tests.test_drafting import drafting_llm
from tests.test_speculative import prompts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([SEPARATOR, 0, 1, 2, 7]), max_size=60))
def test_suffix_array_is_the_sorted_suffixes(tokens) -> None:
    arr = np.asarray(tokens, dtype=np.int32)
    assert build_suffix_array(arr).tolist() == sorted(range(len(tokens)), key=lambda i: tokens[i:])


def corpus_of(answers: list[list[int]], tmp_path) -> AnswerCorpus:
    write_corpus(tmp_path, answers, {"test": True})
    return AnswerCorpus.load(tmp_path)


def test_a_match_continues_where_most_occurrences_agree(tmp_path) -> None:
    gram = [6, 7, 8, 9, 10]
    corpus = corpus_of(
        [
            [5, *gram, 11, 4],
            [1, *gram, 2],
            [3, *gram, 11, 4, 4],
            [20, 21, 22, 23, 24, *range(30, 36)],
        ],
        tmp_path,
    )
    # the 5-gram occurs three times: 11 (twice) before 2, then 11's two occurrences agree on 4,
    # then one answer ends and the other goes on: no majority past that
    assert corpus.match([0, *gram], 5) == ([11, 4], 5)
    assert corpus.match([0, *gram], 1) == ([11], 5)
    # the longest n-gram first: this 8-gram ends its answer, so its 5-gram suffix drafts
    assert corpus.match([5, *gram, 11, 4], 3) == ([4], 5)
    assert corpus.match([3, *gram, 11, 4], 3) == ([4], 8)
    # a 5-gram's match drafts at most MAX_DRAFTS[5], an 8-gram's as many as asked
    assert corpus.match([20, 21, 22, 23, 24], 8) == ([30, 31, 32, 33], 5)
    assert corpus.match([20, 21, 22, 23, 24, 30, 31, 32], 8) == ([33, 34, 35], 8)
    assert corpus.match([7, 8, 9, 10], 4) == ([], 0)  # shorter than every n-gram size
    assert corpus.match([1, 2, 3, 4, 5], 4) == ([], 0)
    assert corpus.match(gram, 0) == ([], 0)


def test_no_match_spans_two_answers(tmp_path) -> None:
    corpus = corpus_of([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], tmp_path)
    assert corpus.match([2, 3, 4, 5, 6], 2) == ([], 0)  # 5 | 6 is an answer boundary
    assert corpus.match([6, 7, 8, 9, 10], 3) == ([11], 5)


@pytest.fixture(scope="module")
def answers(llama_dir) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and the tiny model's own greedy answers to them (speculation off)."""
    ps = prompts(6)
    llm = LLM(str(llama_dir), num_kv_blocks=256, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return ps, [r.outputs[0].token_ids for r in llm.generate(ps, greedy)]


@pytest.mark.parametrize("method", ["corpus", "auto"])
def test_corpus_drafts_are_lossless_and_kept(llama_dir, answers, tmp_path, method) -> None:
    """The corpus holds the model's greedy answers to these very prompts: greedy output is
    identical with corpus drafts on, and most of what the corpus drafts is kept."""
    ps, want = answers
    write_corpus(tmp_path, want, {"test": True})
    llm = drafting_llm(llama_dir, 4, method, speculative_corpus=str(tmp_path))
    assert "corpus" in llm.engine.drafter.sources
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate(ps, greedy)]
    assert got == want
    stats = llm.engine.drafter.stats["corpus"]
    assert stats.num_accepted_tokens > 30
    assert stats.num_accepted_tokens > 0.6 * stats.num_draft_tokens
    assert llm.engine.kv.pool.num_free_blocks == 256


def test_corpus_method_without_a_corpus_is_refused(llama_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="no answer corpus"):
        LLM(str(llama_dir), num_kv_blocks=64, block_size=4, speculative_method="corpus")
    with pytest.raises(ValueError, match="answers.tokens.npy"):
        LLM(str(llama_dir), num_kv_blocks=64, block_size=4, speculative_corpus=str(tmp_path))
    # auto without a corpus for these weights simply has no corpus source
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=4, num_speculative_tokens=4)
    assert "corpus" not in llm.engine.drafter.sources
