"""kvbench.common.musique's answer metrics against hand-computed SQuAD-style examples.

(The prompt layout needs the real model's tokenizer: tests/realmodel/test_musique_prompt.py.)
"""

from __future__ import annotations

import pytest

from kvbench.common import musique


def test_normalize_drops_case_punctuation_articles_and_extra_spaces():
    assert musique.normalize("  The Cat's,  hat!  ") == "cats hat"
    assert musique.normalize("A an THE") == ""


def test_f1_ignores_articles_case_and_punctuation():
    assert musique.f1("the Exeter college", ["Exeter College"]) == 1.0
    assert musique.exact_match("The Exeter College.", ["Exeter College"]) == 1.0


def test_f1_is_token_overlap():
    assert musique.f1("Exeter", ["Exeter College"]) == pytest.approx(2 / 3)  # p 1, r 1/2
    # common {oxford, university}: p 2/3, r 1 -> 0.8
    assert musique.f1("University of Oxford", ["Oxford University"]) == pytest.approx(0.8)
    assert musique.f1("Paris France", ["Rome"]) == 0.0


def test_f1_and_em_take_the_best_gold_answer():
    assert musique.f1("Paris", ["London", "Paris"]) == 1.0
    assert musique.exact_match("paris", ["London", "Paris"]) == 1.0
    assert musique.exact_match("Paris, France", ["Paris"]) == 0.0


def test_an_empty_answer_scores_zero_against_a_real_one():
    assert musique.f1("", ["Paris"]) == 0.0
    assert musique.exact_match("", ["Paris"]) == 0.0


def test_rouge_l_is_the_f1_of_the_longest_common_subsequence():
    # normalized: "cat sat on mat" vs "cat on mat": LCS 3, p 3/4, r 1 -> 6/7
    assert musique.rouge_l("the cat sat on the mat", "the cat on the mat") == pytest.approx(6 / 7)
    assert musique.rouge_l("red blue", "blue red") == pytest.approx(0.5)  # order counts, unlike F1
    assert musique.f1("red blue", ["blue red"]) == 1.0
    assert musique.rouge_l("Helen Mirren", "helen mirren.") == 1.0


def test_rouge_l_of_empty_answers():
    assert musique.rouge_l("", "") == 1.0
    assert musique.rouge_l("the", "Paris") == 0.0  # "the" normalizes to nothing
