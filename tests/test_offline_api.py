"""The offline API takes vLLM's prompt forms, and says what it got when it cannot take one."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=64)


def test_every_prompt_form_gives_the_same_tokens(llm) -> None:
    text = "Paris is the capital of"
    ids = llm.tokenizer.encode(text)
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    outs = [llm.generate(form, GREEDY)[0] for form in forms]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    batch = llm.generate(forms, GREEDY)
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"text": "hi"}, "got keys ['text']"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
        ([[1.5, 2]], "got list"),
        ([{"prompt_token_ids": ["a"]}], "got list"),
        ([None], "got NoneType"),
        ([[True, 3]], "got list"),
    ],
)
def test_a_prompt_it_cannot_take_is_a_value_error(llm, bad, needle) -> None:
    with pytest.raises(ValueError, match="a prompt is|a dict prompt") as e:
        llm.generate(bad, GREEDY)
    assert needle in str(e.value)
    assert not llm.engine.has_unfinished()
