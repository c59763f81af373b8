"""A small deterministic tokenizer shared by the simulated render server and engines.

Special tokens, then the 256 bytes (any text round-trips), then a fixed word vocabulary (with and
without a leading space) so ordinary English costs about one token per word, like a real BPE."""

from __future__ import annotations

import re
from functools import cached_property

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
    "</tool_call>", "<tools>", "</tools>", "<tool_response>", "</tool_response>",
)  # fmt: skip
BYTE_OFFSET = len(SPECIAL_TOKENS)
WORD_OFFSET = BYTE_OFFSET + 256

# Common English words plus the vocabulary the simulated engines generate from.
WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we
say her she or an will my one all would there their what so up out if about who get which go me
when make can like time no just him know take people into year your good some could them see
other than then now look only come its over think also back after use two how our work first
well way even new want because any these give day most us is are was were been has had did said
made found model token prefill decode render cache block request answer question tool call
weather city temperature result value function name arguments reasoning step check fact number
list because therefore first second third finally let me consider note since however while each
both more less true false yes sense problem solution compute sum total plus minus equals hello
world thanks please sure here what why where which whose during before after above below
between under again further once hour minute second fast slow large small big long short high
low open close start stop run
""".split()  # noqa: SIM905 - a word list reads best as text

PIECE = re.compile(
    "|".join(re.escape(t) for t in SPECIAL_TOKENS) + r"| ?[A-Za-z]+|[^A-Za-z]", re.DOTALL
)


class SimTokenizer:
    """encode/decode with exact round trips; eos is <|endoftext|>, <|im_end|> ends a turn."""

    eos_token_id = 0
    im_end_token_id = SPECIAL_TOKENS.index("<|im_end|>")

    @cached_property
    def _word_ids(self) -> dict[str, int]:
        ids: dict[str, int] = {}
        for word in WORDS:
            for piece in (word, " " + word):
                ids.setdefault(piece, WORD_OFFSET + len(ids))
        return ids

    @cached_property
    def _pieces(self) -> list[str]:
        return list(self._word_ids)

    @property
    def vocab_size(self) -> int:
        return WORD_OFFSET + len(self._word_ids)

    def special_id(self, token: str) -> int:
        return SPECIAL_TOKENS.index(token)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in PIECE.findall(text):
            if piece in SPECIAL_TOKENS:
                ids.append(SPECIAL_TOKENS.index(piece))
            elif (word_id := self._word_ids.get(piece)) is not None:
                ids.append(word_id)
            else:
                ids.extend(BYTE_OFFSET + b for b in piece.encode())
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for token in ids:
            out += self.token_bytes(token, skip_special_tokens=skip_special_tokens)
        return out.decode(errors="replace")

    def token_bytes(self, token: int, *, skip_special_tokens: bool = False) -> bytes:
        """The UTF-8 bytes one token adds to the text (a character may span byte tokens)."""
        if token < 0 or token >= self.vocab_size:
            raise ValueError(
                f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if token < BYTE_OFFSET:
            return b"" if skip_special_tokens else SPECIAL_TOKENS[token].encode()
        if token < WORD_OFFSET:
            return bytes([token - BYTE_OFFSET])
        return self._pieces[token - WORD_OFFSET].encode()

    def word_ids(self) -> list[int]:
        """Ids of whole words with a leading space: what generated text is made of."""
        return [i for piece, i in self._word_ids.items() if piece.startswith(" ")]
