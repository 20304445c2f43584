"""Prompt-lookup drafts (``drafting.NgramIndex``) on crafted token lists: the longest suffix that
occurred earlier proposes what followed its latest occurrence, and the index stays right as the
list grows."""

from __future__ import annotations

import random

import pytest

from services.worker.drafting import NgramIndex


def test_a_repeated_phrase_proposes_what_followed_it() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3]
    assert NgramIndex().propose(tokens, 3) == [4, 5, 6]


def test_the_longest_suffix_wins_over_a_later_shorter_match() -> None:
    # "2 3" followed by 7 most recently, but "1 2 3" (longer) was followed by 4
    tokens = [1, 2, 3, 4, 8, 2, 3, 7, 1, 2, 3]
    assert NgramIndex(max_n=3).propose(tokens, 1) == [4]
    assert NgramIndex(max_n=2).propose(tokens, 1) == [7]  # "2 3": its latest occurrence


def test_nothing_seen_before_proposes_nothing() -> None:
    assert NgramIndex().propose([1, 2, 3, 4], 4) == []
    assert NgramIndex().propose([], 4) == []
    assert NgramIndex().propose([5], 4) == []


def test_min_n_refuses_short_matches() -> None:
    tokens = [1, 2, 9, 8, 2]  # only the 1-gram "2" occurred before
    assert NgramIndex(min_n=1).propose(tokens, 2) == [9, 8]
    assert NgramIndex(min_n=2).propose(tokens, 2) == []


def test_a_loop_is_continued_past_the_end_of_what_is_written() -> None:
    assert NgramIndex().propose([7, 7, 7], 4) == [7, 7, 7, 7]
    assert NgramIndex().propose([5, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_k_caps_the_draft() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert NgramIndex().propose(tokens, 2) == [2, 3]
    assert NgramIndex().propose(tokens, 0) == []


def test_the_index_follows_appended_tokens() -> None:
    """Incremental use gives what a fresh index over the whole list gives, at every length."""
    tokens: list[int] = []
    index = NgramIndex()
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    for t in text:
        tokens.append(t)
        assert index.propose(tokens, 3) == NgramIndex().propose(tokens, 3), tokens


def reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule spelled out: the longest suffix (up to ``max_n``) that occurred earlier, its
    latest occurrence, and what followed it, repeated past the end."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        for e in range(end - 2, n - 2, -1):
            if tokens[e - n + 1 : e + 1] == tokens[end - n :]:
                return [tokens[e + 1 + i % (end - e - 1)] for i in range(k)]
    return []


@pytest.mark.parametrize("scan", [NgramIndex.SCAN, 0])  # a pair's ends one by one, or in numpy
@pytest.mark.parametrize(("max_n", "min_n"), [(4, 1), (3, 2), (1, 1)])
def test_random_lists_get_what_the_rule_says(max_n: int, min_n: int, scan: int) -> None:
    rng = random.Random(max_n * 10 + min_n)
    for _ in range(40):
        alphabet = rng.randint(2, 12)  # few symbols: long and short matches, and none
        tokens: list[int] = []
        index = NgramIndex(max_n, min_n)
        index.SCAN = scan
        for _ in range(rng.randint(1, 90)):
            tokens.append(rng.randrange(alphabet))
            k = rng.randint(0, 5)
            assert index.propose(tokens, k) == reference(tokens, k, max_n, min_n), tokens


def test_a_pair_seen_often_is_searched_alike_either_way() -> None:
    """A pair recurring more than ``SCAN`` times, mostly with other tokens before it: the
    vectorized search finds the one longer match the scan would, and keeps up as tokens grow."""
    tokens = [t for i in range(200) for t in (1000 + i, 5, 6)] + [7, 8, 5, 6, 9, 7, 8, 5, 6]
    scanned, vectorized = NgramIndex(), NgramIndex()
    scanned.SCAN, vectorized.SCAN = len(tokens), 0
    for end in range(2, len(tokens) + 1):
        want = reference(tokens[:end], 3, 4, 1)
        assert scanned.propose(tokens[:end], 3) == vectorized.propose(tokens[:end], 3) == want
    assert vectorized.matched == 4 and vectorized.propose(tokens, 3) == [9, 7, 8]


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="n-gram"):
        NgramIndex(max_n=2, min_n=3)
    with pytest.raises(ValueError, match="n-gram"):
        NgramIndex(min_n=0)
