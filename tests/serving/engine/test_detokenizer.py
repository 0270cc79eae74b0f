from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.types import GenerationRequest, SamplingParams


class CharTokenizer:
    """Token i decodes to the i-th piece; enough to test text handling without a real vocabulary."""

    pieces = ["<s>", "Hel", "lo", " wor", "ld", "!", "\n", "EN", "D", " ", "x"] + [f"t{i}" for i in range(117)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[t] for t in token_ids if not (skip_special_tokens and t == 0))


def test_text_streams_incrementally() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), [0], stop=[])
    chunks = []
    for token in [1, 2, 3, 4, 5]:
        detok.append([token])
        chunks.append(detok.take_new_text(finished=False))
    assert chunks == ["Hel", "lo", " wor", "ld", "!"]


def test_stop_string_across_tokens_is_cut_and_never_streamed() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), [0], stop=["END"])
    streamed = ""
    found = None
    for token in [1, 2, 6, 7, 8, 3]:
        found = detok.append([token])
        streamed += detok.take_new_text(finished=found is not None)
        if found:
            break
    assert found == "END"
    assert streamed == "Hello\n"


def test_held_back_text_is_released_when_it_is_not_a_stop() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), [0], stop=["ENDX"])
    detok.append([7])
    assert detok.take_new_text(finished=False) == ""  # "EN" might begin "ENDX"
    detok.append([3])
    assert detok.take_new_text(finished=False) == "EN "  # "wor" could still begin a stop: held back
    assert detok.take_new_text(finished=True) == "wor"


def test_engine_stops_on_a_stop_string(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    engine.tokenizer = CharTokenizer()
    prompt = kit.random_prompts([10])[0]
    free_run = kit.run_to_completion(engine, [prompt], [SamplingParams(temperature=0, max_tokens=30,
                                                                        ignore_eos=True)])[0]
    text = CharTokenizer().decode(free_run)
    stop = text[12:16]
    engine.add_request(GenerationRequest("s", prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop])))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert "".join(o.new_text for o in outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
