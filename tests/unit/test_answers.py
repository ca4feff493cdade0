"""Exact match and F1 against hand-computed cases (SQuAD's normalisation and token-overlap F1)."""

import pytest

from distzo.data.answers import exact_match, f1_score, normalize_answer


@pytest.mark.parametrize("text,norm", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  an   apple, a pear ", "apple pear"),
    ("Theatre", "theatre"),             # "the" inside a word stays
    ("U.S.A.", "usa"),
    ("", ""),
])
def test_normalisation(text, norm):
    assert normalize_answer(text) == norm


def test_exact_match_takes_any_accepted_answer():
    assert exact_match("the Paris", ["London", "paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("", [""]) == 1.0 and exact_match("x", [""]) == 0.0


def test_f1_by_hand():
    # prediction tokens [new, york, city], answer [new, york]: precision 2/3, recall 1, F1 0.8
    assert f1_score("New York City", ["new york"]) == pytest.approx(0.8)
    # repeated tokens count with multiplicity: [a, b, b] vs [b, b, c] -> common 2: P = R = 2/3
    assert f1_score("a1 b2 b2", ["b2 b2 c3"]) == pytest.approx(2 / 3)
    # the best over several answers; articles and punctuation do not count
    assert f1_score("The Beatles.", ["Rolling Stones", "the beatles", "Beatles band"]) == 1.0
    assert f1_score("Beatles", ["Beatles band", "Stones"]) == pytest.approx(2 / 3)  # P 1, R 1/2
    assert f1_score("nothing alike", ["zebra"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to nothing
