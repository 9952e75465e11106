"""A small byte-level BPE tokenizer trained offline on a generated English-like corpus.

The corpus is a pure function of the seed: sentences drawn with ``random.Random(seed)`` from a
fixed word list plus invented proper nouns (syllable chains) and numbers, so every machine
trains the same merges without downloading anything.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mlx_redis_worker.models.tokenizer_files import SpecialTokens

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
TINY_SPECIALS = SpecialTokens(eos=ENDOFTEXT, pad=ENDOFTEXT, unk=None, extra=SPECIAL_TOKENS)

_WORD_TEXT = """
the of and to in is was for on that with as by at from it his her their this be are were
an or had have has not but which one all they we you he she there been its who when will
more would after also new first other some what time year people two about into over than
only could most then out can made many did through up our may world state such way even
city because where day any back three part used both well these under while between during
life work house long each school water small since old still great place number must world
home called before book name country down around family story end best high known same another
system high few make left right children music local game second small much light night often
around group play war man woman river early set king land love power find come us course early
morning evening garden window table kitchen letter market road bridge mountain forest island
village station street harbor valley field winter summer spring autumn rain snow wind sun moon
star sky sea ocean lake stone gold silver iron wood paper bread apple orange coffee tea milk
horse dog cat bird fish tree flower grass leaf seed door wall roof floor chair bed lamp clock
doctor teacher farmer baker painter writer singer sailor soldier student child friend mother
father brother sister uncle aunt neighbor stranger captain queen prince princess knight giant
walk run jump swim read write sing dance think know see look hear speak tell ask answer help
open close begin finish carry bring hold keep give take send build break grow fall rise turn
happy sad quiet loud bright dark warm cold soft hard quick slow young ancient strange simple
careful gentle brave clever honest kind proud calm busy empty full heavy narrow wide deep
always never sometimes usually soon later today tomorrow yesterday here nearly almost quite
very really again together alone already perhaps suddenly slowly quickly finally however
because although unless until while whether though since therefore meanwhile otherwise
question reason idea problem answer voice picture color shape sound smell taste memory dream
journey adventure secret treasure mystery lesson promise choice chance moment season history
"""
WORDS = tuple(_WORD_TEXT.split())

_SYLLABLE_TEXT = """
ka lo ren mi sa tor vel an is ber dor fa gim hal ju kel mor nel os pra quin ril sel tam
ul vor wen xa yel zor bri cal den ef gor hin ith jor kor lan mar nor ol per ros sin tus
"""
SYLLABLES = tuple(_SYLLABLE_TEXT.split())

PUNCTUATION = (".", ".", ".", "!", "?")


def _proper_nouns(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))
        names.add(name.capitalize())
    return sorted(names)


def _sentence(rng: random.Random, names: list[str]) -> str:
    words: list[str] = []
    for _ in range(rng.randint(4, 16)):
        roll = rng.random()
        if roll < 0.12:
            words.append(rng.choice(names))
        elif roll < 0.16:
            words.append(str(rng.randint(0, 9999)))
        else:
            words.append(rng.choice(WORDS))
        if rng.random() < 0.06:
            words[-1] += ","
    words[0] = words[0].capitalize()
    return " ".join(words).rstrip(",") + rng.choice(PUNCTUATION)


def corpus(seed: int, documents: int, names: int = 3000) -> Iterator[str]:
    """``documents`` short paragraphs of English-like text, a pure function of ``seed``."""
    rng = random.Random(seed)
    nouns = _proper_nouns(rng, names)
    for _ in range(documents):
        sentences = [_sentence(rng, nouns) for _ in range(rng.randint(1, 6))]
        yield " ".join(sentences) + ("\n" if rng.random() < 0.3 else "")


def train_tokenizer(vocab_size: int, seed: int = 0, documents: int = 20000) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` entries (specials first: ids 0, 1, 2)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed, documents), trainer=trainer, length=documents)
    return tokenizer
