"""The shipped text corpus: both splits present, every kind covered, no text in both."""

from glyd_engine.corpus import KINDS, calibration_texts, heldout_texts


def test_splits_cover_every_kind_and_never_overlap():
    cal, held = calibration_texts(), heldout_texts()
    assert {t.kind for t in cal} == set(KINDS)
    assert len({t.language for t in cal if t.kind == "multilingual"}) >= 4
    assert all(len(t.text) > 1000 for t in cal + held)
    def lines(texts):
        return {ln.strip() for t in texts for ln in t.text.splitlines()
                if len(ln.strip()) > 60 and any(ch.isalpha() for ch in ln)}

    cal_lines, held_lines = lines(cal), lines(held)
    assert not cal_lines & held_lines
