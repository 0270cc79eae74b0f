"""Train the demo byte-level BPE tokenizer on the training split of the stdlib corpus.

    python -m serving.demo.build_tokenizer [--out DIR] [--vocab-size 4096] [--max-files N]

Writes a transformers tokenizer (``AutoTokenizer.from_pretrained(DIR)`` works) with a
ChatML chat template, and refreshes ``heldout_files.txt`` when run on the full corpus.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from serving.demo import corpus

log = logging.getLogger(__name__)

DEFAULT_OUT = Path(__file__).with_name("tokenizer")
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 4096, max_files: int | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    train_files, heldout = corpus.split()
    if max_files is None:
        corpus.write_heldout_list(heldout)
    else:
        train_files = train_files[:max_files]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.read_texts(train_files), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        model_max_length=2048,
        chat_template=CHAT_TEMPLATE,
    )
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    out.mkdir(parents=True, exist_ok=True)
    # template inside tokenizer_config.json: one file fewer to ship, and *.json is package data
    fast.save_pretrained(str(out), save_jinja_files=False)
    log.info("tokenizer: %d tokens, trained on %d files -> %s", len(fast), len(train_files), out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-files", type=int, default=None, help="train on the first N files (tests)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    build_tokenizer(args.out, args.vocab_size, args.max_files)


if __name__ == "__main__":
    main()
