"""A draft model restricted to the tokens a target actually writes (`speculative.draft_token_map`).

A small draft spends most of a drafting step in its lm_head: the demo draft's 4,096 x 128 head is 2 MB of its
3.2 MB of weights read per token, 0.52 of its 0.82 M multiply-adds. Most of that vocabulary is never the
target's next token. A token map is a JSON list of the token ids the draft may propose (the most frequent ones
in text like the target's, as FR-Spec and EAGLE-3's reduced draft vocabulary do); the draft's lm_head keeps
only those rows, and its logits for every other token are UNMAPPED_LOGIT. Everything after the head (argmax,
the draft's distribution for rejection sampling, grammar masks, the compiled rollout) sees full-vocabulary
logits as before, so speculation stays lossless: a token outside the map is never proposed (the draft's
probability for it is 0, which rejection sampling accounts for) and the target still writes it when the draft
is rejected.

The file sits in the draft model's directory, so it travels and is verified with the draft's weights; the
config names it relative to that directory. `python -m serving.engine.spec.token_map build` counts token
frequencies over text files with the model's tokenizer and writes the most frequent ids.

UNMAPPED_LOGIT is finite rather than -inf so that a row whose every mapped token a grammar forbids still has a
finite maximum among the allowed tokens (their softmax is then uniform; the target decides anyway), while for
any other row e^(UNMAPPED_LOGIT - max) is exactly 0 in fp32, as -inf would be. It stays finite under the
temperatures and penalties logit processing applies (1e30 / 0.01 = 1e32).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from serving.config import TOKEN_MAP_NAME, check_token_map_name
from serving.files import atomic_write

UNMAPPED_LOGIT = -1e30


class TokenMapError(ValueError):
    """A token map that cannot be used; the message names the file and the problem."""


def token_map_path(draft_dir: str | Path, name: str) -> Path:
    """Where `name` (speculative.draft_token_map, relative to the draft model's directory) lives."""
    try:
        check_token_map_name(name)
    except ValueError as e:
        raise TokenMapError(str(e)) from None
    return Path(draft_dir) / name


def resolve(draft_dir: str | Path, setting: str | None) -> tuple[str | None, str]:
    """The token map file the draft uses for `speculative.draft_token_map` (None: the full vocabulary), and why.

    auto takes the draft directory's TOKEN_MAP_NAME when the directory's manifest.json lists it, so that it was
    pushed, pulled and hash-verified with the weights; a directory without a manifest (a local checkout) has
    nothing to check it against and its file is taken as it is. A map beside a manifest that does not list it
    is refused, with the reason. An explicit name is used as given."""
    from serving.weights.manifest import MANIFEST_NAME, WeightsError, load_manifest

    if setting is None:
        return None, "speculative.draft_token_map is none"
    if setting != "auto":
        return setting, "speculative.draft_token_map names it"
    directory = Path(draft_dir)
    if not (directory / TOKEN_MAP_NAME).is_file():
        return None, f"auto: the draft's directory has no {TOKEN_MAP_NAME}"
    if not (directory / MANIFEST_NAME).exists():
        return TOKEN_MAP_NAME, (f"auto: {TOKEN_MAP_NAME} in the draft's directory (no {MANIFEST_NAME} to check it "
                                "against)")
    try:
        listed = {entry.path for entry in load_manifest(directory).files}
    except WeightsError as e:
        return None, f"auto: not used, the draft's {MANIFEST_NAME} cannot be read ({e})"
    if TOKEN_MAP_NAME not in listed:
        return None, (f"auto: not used, {TOKEN_MAP_NAME} is in the draft's directory but not in its {MANIFEST_NAME}, "
                      f"so it was not verified with the weights (name it in speculative.draft_token_map to use it)")
    return TOKEN_MAP_NAME, f"auto: {TOKEN_MAP_NAME}, listed in the draft's {MANIFEST_NAME}"


def read_token_map(path: Path, vocab_size: int) -> torch.Tensor:
    """The token ids of a token map file, sorted: a JSON list of distinct integers in [0, vocab_size)."""
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError:
        raise TokenMapError(f"token map {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenMapError(f"token map {path} is not readable JSON: {e}") from e
    if not isinstance(ids, list) or not ids:
        raise TokenMapError(f"token map {path} must be a non-empty JSON list of token ids")
    bad = next((i for i in ids if not isinstance(i, int) or isinstance(i, bool)), None)
    if bad is not None:
        raise TokenMapError(f"token map {path} holds {bad!r}, which is not a token id (an integer)")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise TokenMapError(f"token map {path}: token id {outside[0]} is outside the draft's vocabulary of "
                            f"{vocab_size} ({len(outside)} such ids)")
    if len(set(ids)) != len(ids):
        raise TokenMapError(f"token map {path} lists {len(ids) - len(set(ids))} token id(s) twice")
    return torch.tensor(sorted(ids), dtype=torch.long)


class TokenMapHead(nn.Module):
    """An lm_head that computes the logits of the mapped tokens only: [.., dim] -> [.., vocab], UNMAPPED_LOGIT
    for every token outside the map."""

    ids: torch.Tensor

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = weight.shape[0]
        self.register_buffer("ids", ids.to(weight.device))
        self.weight = nn.Parameter(weight.detach().index_select(0, self.ids).clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapped = nn.functional.linear(x, self.weight)
        logits = mapped.new_full((*mapped.shape[:-1], self.vocab_size), UNMAPPED_LOGIT)
        return logits.index_copy_(-1, self.ids, mapped)


def apply_token_map(model: nn.Module, ids: torch.Tensor) -> None:
    """Replace the model's lm_head (`output`, an nn.Linear without bias) by a TokenMapHead over `ids`. A tied
    head gets its own rows; the embedding keeps its table."""
    head = model.output
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise TokenMapError(f"a token map needs the draft's lm_head to be a plain linear layer, not {head!r}")
    model.output = TokenMapHead(head.weight, ids)


def most_frequent(token_streams: Iterable[torch.Tensor], size: int, vocab_size: int) -> list[int]:
    """The `size` most frequent token ids over the streams (ties: the lower id first), most frequent first."""
    if size > vocab_size:
        raise TokenMapError(f"a token map of {size} tokens is larger than the vocabulary ({vocab_size})")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for stream in token_streams:
        counts += torch.bincount(stream.flatten().long(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices  # stable: equal counts keep ascending ids
    return order[:size].tolist()


def write_token_map(ids: list[int], path: Path) -> None:
    """Write the map whole or not at all (serving.files.atomic_write), creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(ids) + "\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m serving.engine.spec.token_map build --tokenizer DIR --size N --out FILE TEXT...`"""
    parser = argparse.ArgumentParser(prog="python -m serving.engine.spec.token_map")
    actions = parser.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="write the N most frequent token ids over text files as a token map")
    build.add_argument("texts", nargs="+", type=Path, help="text files like what the target writes (UTF-8)")
    build.add_argument("--tokenizer", type=Path, required=True, help="the target's model directory (tokenizer)")
    build.add_argument("--size", type=int, required=True, help="tokens in the map")
    build.add_argument("--out", type=Path, required=True,
                       help="the map to write, normally <draft model directory>/token_map.json")
    args = parser.parse_args(argv)
    if args.size < 1:
        parser.exit(2, "error: --size must be a positive integer\n")
    missing = [str(p) for p in args.texts if not p.is_file()]
    if missing:
        parser.exit(1, f"error: no such text file: {', '.join(missing)}\n")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    except (OSError, ValueError) as e:
        parser.exit(1, f"error: cannot load a tokenizer from {args.tokenizer}: {e}\n")
    streams = (torch.tensor(tokenizer(p.read_text(errors="replace"), add_special_tokens=False)["input_ids"])
               for p in args.texts)
    try:
        ids = most_frequent(streams, args.size, len(tokenizer))
        write_token_map(ids, args.out)
    except (TokenMapError, OSError) as e:
        parser.exit(1, f"error: {e}\n")
    sys.stdout.write(f"{args.out}: {len(ids)} token ids\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
