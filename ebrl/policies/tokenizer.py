"""PaliGemma's SentencePiece tokenizer and the prompts pi0 and pi0.5 were trained on, as openpi builds them.

openpi (models/tokenizer.py, PaligemmaTokenizer) loads `paligemma_tokenizer.model` with `sentencepiece`:
- pi0: the cleaned instruction (strip, "_" -> " ", "\\n" -> " ") encoded with BOS, then "\\n" encoded on its own (the
  start-of-answer token); 48 tokens;
- pi0.5: "Task: {cleaned}, State: {bins};\\nAction: " encoded with BOS, where bins are the normalised state's dims
  digitised into 256 bins over [-1, 1] (np.digitize(state, linspace(-1, 1, 257)[:-1]) - 1), written as integers
  separated by spaces; 200 tokens.
Right-padded with id 0 and a False mask; a longer prompt is truncated to the budget. The model file comes from the
checkpoint folder (tokenizer.model or paligemma_tokenizer.model) or `policy.tokenizer=<file>`; nothing is fetched.

lerobot's processors (0.4: Pi0NewLineProcessor, Pi05PrepareStateTokenizerProcessorStep, then its tokenizer step)
differ, and a checkpoint lerobot fine-tuned was trained on theirs (style="lerobot"): pi0's instruction is not cleaned
and "\n" is appended to it before one encoding; pi0.5's state is zero-padded to max_state_dim before it is
digitised. The parity tests check both styles' tokens against those processors.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ebrl.config import ConfigError

MODEL_NAMES = ("tokenizer.model", "paligemma_tokenizer.model")
STATE_BINS = 256
MAX_TOKENS = {"pi0": 48, "pi05": 200}  # openpi's Pi0Config.max_token_len for each
STYLES = ("openpi", "lerobot")


def clean(prompt: str) -> str:
    return prompt.strip().replace("_", " ").replace("\n", " ")


def discretize_state(state: np.ndarray) -> np.ndarray:
    """pi0.5's state bins: each normalised dim in 0..255, as openpi computes them (np.digitize: a value below -1
    gives -1, one at or above 1 gives 255)."""
    return np.digitize(state, bins=np.linspace(-1, 1, STATE_BINS + 1)[:-1]) - 1


def find_tokenizer(folder: Path) -> Path | None:
    for name in MODEL_NAMES:
        if (folder / name).is_file():
            return folder / name
    return None


class PaligemmaTokenizer:
    """openpi's prompt rules over a SentencePiece model file."""

    def __init__(self, path: str | Path, max_len: int, style: str = "openpi") -> None:
        if style not in STYLES:
            raise ConfigError(f"policy.prompt_style={style!r} is not available; accepted: {', '.join(STYLES)}")
        self.style = style
        p = Path(path).expanduser()
        if p.is_dir():
            found = find_tokenizer(p)
            if found is None:
                raise ConfigError(
                    f"policy.tokenizer={path} holds no {' or '.join(MODEL_NAMES)}; give PaliGemma's "
                    "SentencePiece model file"
                )
            p = found
        if not p.is_file():
            raise ConfigError(
                f"policy.tokenizer={path} does not exist; give PaliGemma's SentencePiece model file "
                "(paligemma_tokenizer.model)"
            )
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError(
                "policy.tokenizer needs the sentencepiece package: pip install -r requirements.txt"
            ) from None
        self.processor = sentencepiece.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(p.read_bytes())
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with a long C++ message
            raise ConfigError(f"policy.tokenizer={path} is not a SentencePiece model ({type(e).__name__})") from None
        self.path, self.max_len = p, max_len
        self.vocab_size = self.processor.GetPieceSize()

    def ids(self, prompt: str, state: np.ndarray | None = None) -> list[int]:
        """The prompt's token ids, unpadded: pi0's without a state, pi0.5's with its normalised state."""
        text = clean(prompt)
        if state is None and self.style == "lerobot":
            return self.processor.Encode(prompt + "\n", add_bos=True)
        if state is None:
            return self.processor.Encode(text, add_bos=True) + self.processor.Encode("\n")
        bins = " ".join(map(str, discretize_state(np.asarray(state))))
        return self.processor.Encode(f"Task: {text}, State: {bins};\nAction: ", add_bos=True)

    def pad(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.zeros((len(rows), self.max_len), np.int64)
        mask = np.zeros((len(rows), self.max_len), bool)
        for i, ids in enumerate(rows):
            ids = ids[: self.max_len]
            tokens[i, : len(ids)], mask[i, : len(ids)] = ids, True
        return tokens, mask

    def tokenize(self, texts: list[str], states: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens (B, max_len) int64, mask (B, max_len) bool) for B prompts (and B normalised states for pi0.5)."""
        return self.pad([self.ids(t, None if states is None else states[i]) for i, t in enumerate(texts)])

    def decode(self, ids: list[int]) -> str:
        return self.processor.Decode(ids)


def train_gemma_like(path: str | Path, texts: list[str], vocab_size: int = 400) -> Path:
    """A small SentencePiece model set up the way Gemma's (PaliGemma's) is: BPE with byte fallback, digits split, no
    normalisation or dummy prefix, "\\n" a piece of its own, ids pad 0 / eos 1 / bos 2 / unk 3. What the tests and
    benchmarks tokenize with, since PaliGemma's own model file is not fetched."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts) * 50),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["\n"],
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    out = Path(path)
    out.write_bytes(model.getvalue())
    return out
