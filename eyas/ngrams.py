"""Word n-grams: overlap between text collections, and a cheap near-duplicate filter.

Words are runs of letters and digits, lower-cased (`words`); punctuation, case and spacing do
not matter, and an n-gram never spans two texts (give each turn as its own text).

- `ngram_overlap(texts_a, texts_b, n=8)`: which word n-grams of `texts_a` occur anywhere in
  `texts_b`. `texts_b` is streamed, so it can be a whole training set; the set of n-grams kept in
  memory is `texts_a`'s. The eval-set test uses it against the training data (none may match).
- `shared_ngram_pairs(texts, n=8)`: pairs of texts within one collection sharing an n-gram.
- `NearDuplicates`: Jaccard similarity of word-shingle sets against everything kept so far,
  through an inverted index (cost per text: the texts that share a shingle with it, not all of them).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """Lower-cased runs of letters and digits."""
    return _WORD.findall(text.lower())


def ngrams(text: str, n: int) -> set[str]:
    """The distinct word n-grams of `text`, each as its words joined by one space (none if shorter)."""
    w = words(text)
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


@dataclass
class Overlap:
    """Result of `ngram_overlap`: `shared` maps each n-gram found in both to the indices of the
    `texts_a` holding it; the counts say how much was compared."""

    n: int
    shared: dict[str, list[int]] = field(default_factory=dict)
    a_ngrams: int = 0          # distinct n-grams of texts_a
    b_texts: int = 0           # texts of texts_b scanned
    b_ngrams: int = 0          # n-grams of texts_b scanned (with repeats)

    def __bool__(self) -> bool:
        return bool(self.shared)

    def describe(self, texts_a: list[str], limit: int = 5) -> str:
        """One line naming the first few shared n-grams and where they are in texts_a."""
        shown = [f"'{g}' (in {texts_a[idx[0]][:60]!r})" for g, idx in list(self.shared.items())[:limit]]
        return f"{len(self.shared)} shared {self.n}-grams: " + "; ".join(shown)


def ngram_overlap(texts_a: Iterable[str], texts_b: Iterable[str], n: int = 8) -> Overlap:
    """The word n-grams of `texts_a` that also occur in `texts_b` (streamed)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    index: dict[str, list[int]] = {}
    for i, text in enumerate(texts_a):
        for gram in ngrams(text, n):
            index.setdefault(gram, []).append(i)
    result = Overlap(n=n, a_ngrams=len(index))
    for text in texts_b:
        result.b_texts += 1
        w = words(text)
        for i in range(len(w) - n + 1):
            result.b_ngrams += 1
            gram = " ".join(w[i:i + n])
            if gram in index and gram not in result.shared:
                result.shared[gram] = index[gram]
    return result


def shared_ngram_pairs(texts: list[str], n: int = 8) -> list[tuple[int, int, str]]:
    """(i, j, n-gram) for each pair of texts i < j sharing a word n-gram (the first one found)."""
    seen: dict[str, int] = {}
    pairs: dict[tuple[int, int], str] = {}
    for j, text in enumerate(texts):
        for gram in sorted(ngrams(text, n)):
            i = seen.setdefault(gram, j)
            if i != j:
                pairs.setdefault((i, j), gram)
    return [(i, j, gram) for (i, j), gram in sorted(pairs.items())]


def shingles(text: str, n: int = 3) -> set[str]:
    """Word n-gram shingles; a text shorter than n words is one shingle of all its words."""
    w = words(text)
    if len(w) < n:
        return {" ".join(w)} if w else set()
    return ngrams(text, n)


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDuplicates:
    """Keeps texts whose shingle-set Jaccard similarity to every text kept so far is below `threshold`.

    `check(text)` returns the index of the kept text it duplicates (None: it is new); `add(text)`
    keeps it. `threshold=1.0` catches only texts with identical shingle sets (the same words in
    the same order, whatever the case and punctuation).
    """

    def __init__(self, threshold: float = 0.7, n: int = 3):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold, self.n = threshold, n
        self._index: dict[str, list[int]] = {}
        self._sizes: list[int] = []

    def __len__(self) -> int:
        return len(self._sizes)

    def check(self, text: str) -> int | None:
        grams = shingles(text, self.n)
        if not grams:
            return None
        common: Counter = Counter()
        for gram in grams:
            common.update(self._index.get(gram, ()))
        best, best_score = None, 0.0
        for kept, inter in common.items():
            score = inter / (len(grams) + self._sizes[kept] - inter)
            if score > best_score:
                best, best_score = kept, score
        return best if best is not None and best_score >= self.threshold else None

    def add(self, text: str) -> int:
        grams = shingles(text, self.n)
        kept = len(self._sizes)
        self._sizes.append(len(grams))
        for gram in grams:
            self._index.setdefault(gram, []).append(kept)
        return kept
