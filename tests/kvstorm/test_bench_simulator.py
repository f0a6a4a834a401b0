"""``kvstorm bench simulator``'s judgement: the simulated value against the mean of the real runs, and "undecided"
only where the real runs of the same seeded load are themselves farther apart than the bound."""

from __future__ import annotations

import pytest

from kvstorm.bench.simulator import Side, compare


def _side(ttft_p99_s: float | None = 1.0, preemptions: int = 0) -> Side:
    return Side(0.1, ttft_p99_s, 0.02, 100.0, preemptions, 50)


@pytest.mark.parametrize(
    ("real_p99s", "simulated_p99", "verdict"),
    [
        ([1.0, 1.04], 1.1, "within"),  # 8% above the mean
        ([1.0, 1.04], 1.3, "outside"),  # 27% above, where the real runs agree within 4%
        ([4.27, 5.09, 7.0], 6.34, "undecided"),  # 16% above; 9% under one run; the runs are 64% apart (measured)
        ([4.27, 5.09], 6.34, "outside"),  # 35% above, 25% above the nearest run: the runs' 19% excuses nothing
        ([1.0, 1.14], 0.86, "outside"),  # 20% under, though 14% under one run: the runs agree within the bound
        ([4.27, 7.0], 5.2, "within"),  # 8% under the mean, however far apart the real runs are
        ([1.0], 1.3, "outside"),  # one real run: no spread to tell anything apart
    ],
)
def test_a_metric_is_judged_against_the_mean_and_the_spread_of_the_real_runs(real_p99s, simulated_p99, verdict):
    comparison = compare("TTFT p99", [_side(p99) for p99 in real_p99s], _side(simulated_p99))
    assert comparison.ratio == pytest.approx(simulated_p99 / (sum(real_p99s) / len(real_p99s)))
    assert comparison.real_spread == pytest.approx(max(real_p99s) / min(real_p99s) - 1)
    assert comparison.verdict == verdict


def test_preemptions_have_their_own_bound_and_a_floor_of_one():
    assert compare("preemptions", [_side(preemptions=20), _side(preemptions=24)], _side(preemptions=19)).verdict == (
        "within"  # 19 against a mean of 22: 14% under, inside 20%
    )
    assert compare("preemptions", [_side(preemptions=20), _side(preemptions=21)], _side(preemptions=15)).verdict == (
        "outside"
    )
    # No preemption in the real runs and one simulated: a difference of one, not an infinite ratio.
    assert compare("preemptions", [_side(preemptions=0)] * 2, _side(preemptions=1)).ratio == pytest.approx(2.0)
    assert compare("preemptions", [_side(preemptions=0)] * 2, _side(preemptions=0)).verdict == "within"


def test_a_metric_a_side_could_not_measure_is_outside_not_within():
    comparison = compare("TTFT p99", [_side(None), _side(1.0)], _side(1.0))
    assert (comparison.ratio, comparison.verdict) == (None, "outside")
