"""Detokenizing and stop strings, on the stories260k tokenizer and hand-made core outputs."""

from __future__ import annotations

import json

import pytest

from flare.engine.outputs import CoreOutput
from flare.engine.sampling_params import SamplingParams
from flare.frontend.detokenizer import IncrementalDetokenizer
from flare.frontend.output_processor import OutputProcessor, partial_stop_length
from flare.frontend.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(stories260k):
    return load_tokenizer(stories260k)


def test_tokenizer_wrapper(tokenizer, stories260k):
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tokenizer.encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]
    assert tokenizer.decode([1, 403, 407]) == "Once upon"
    assert tokenizer.eos_token_ids == (2,)
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_incremental_text_equals_decoding_everything_at_once(tokenizer, stories260k):
    reference = json.loads((stories260k / "reference" / "greedy.json").read_text())
    detokenizer = IncrementalDetokenizer(tokenizer, reference["prompt_ids"])
    pieces = [detokenizer.add([token]) for token in reference["greedy_ids"]]
    assert "".join(pieces) == reference["greedy_text"]
    assert pieces[1] == " there"                    # the SentencePiece leading space survives


def test_a_character_split_over_byte_tokens_waits_until_complete(tokenizer):
    ids = tokenizer.encode("Hi 😀 there")           # the emoji is four byte-fallback tokens
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:3])
    pieces = [detokenizer.add([token]) for token in ids[3:]]
    assert pieces == [" ", "", "", "", "😀", " there"]
    assert all("\ufffd" not in piece for piece in pieces)


def stream(tokenizer, text: str, params: SamplingParams, finish_at_end: bool = False):
    """Feed `text`'s tokens one step at a time; return the outputs and the ids to abort."""
    processor = OutputProcessor(tokenizer)
    prompt = [1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    processor.add_request("r", prompt, params)
    outputs, stopped = [], []
    for i, token in enumerate(ids):
        last = finish_at_end and i == len(ids) - 1
        new, stop = processor.process([CoreOutput("r", (token,), finish_reason="length" if last else None,
                                                  num_prompt_tokens=1)])
        outputs += new
        stopped += stop
        if new and new[-1].finished:
            break
    return outputs, stopped


def test_a_stop_string_spanning_tokens_cuts_the_text_and_aborts_the_request(tokenizer):
    outputs, stopped = stream(tokenizer, "The cat said STOP here and more", SamplingParams(stop=("STOP",)))
    assert "".join(o.new_text for o in outputs) == "The cat said "
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == "STOP"
    assert stopped == ["r"]
    # While "S", "ST", "STO" could still become the stop string, that text was held back.
    assert all("S" not in o.new_text for o in outputs)


def test_include_stop_str_in_output_keeps_it(tokenizer):
    outputs, _ = stream(tokenizer, "The cat said STOP here", SamplingParams(stop=("STOP",), include_stop_str_in_output=True))
    assert "".join(o.new_text for o in outputs) == "The cat said STOP"


def test_held_back_text_is_released_when_it_turns_out_not_to_stop(tokenizer):
    outputs, stopped = stream(tokenizer, "The STAR is bright", SamplingParams(stop=("STOP",)), finish_at_end=True)
    assert "".join(o.new_text for o in outputs) == "The STAR is bright"
    assert outputs[-1].finish_reason == "length" and stopped == []


def test_a_stop_token_adds_no_text(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1], SamplingParams(stop_token_ids=(378,)))
    first, _ = processor.process([CoreOutput("r", (403,))])
    last, stopped = processor.process([CoreOutput("r", (378,), finish_reason="stop", stop_token_id=378)])
    assert first[0].new_text == "Once" and last[0].new_text == ""
    assert last[0].stop_reason == 378 and last[0].num_output_tokens == 2 and stopped == []


def test_partial_stop_length():
    assert partial_stop_length("abc ST", ["STOP"]) == 2
    assert partial_stop_length("abc", ["STOP"]) == 0
    assert partial_stop_length("x\n\n", ["\n\n\n", "xy"]) == 2


def test_eos_ids_join_the_tokenizer_and_generation_config(tmp_path):
    from flare.frontend.tokenizer import eos_token_ids_of

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert eos_token_ids_of(tmp_path, 128009) == [128009, 128001]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids_of(tmp_path, None) == [7]
