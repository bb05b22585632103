import numpy as np
import pytest

from servematrix.workload.schedule import (
    arrival_times,
    bench_serve_019_sends,
    benchmark_serving_08_sends,
    benchmark_serving_08_sharegpt_sends,
)


def test_matches_vllm_benchmark_client_with_seed_0():
    # Targets computed from vLLM's pre-V1 client (np.random.seed(0), exponential gaps):
    # inter-arrival sums of 199 draws per QPS, and the first gaps at QPS 2.
    expected_last = {2: 98.219, 4: 49.109, 6: 32.740, 8: 24.555}
    for qps, last in expected_last.items():
        times = arrival_times(200, qps, 1.0, 0)
        assert times[0] == 0.0
        assert times[-1] == pytest.approx(last, abs=5e-4)
    gaps = np.diff(arrival_times(200, 2, 1.0, 0))[:5]
    assert gaps == pytest.approx([0.3979, 0.6280, 0.4616, 0.3936, 0.2755], abs=5e-5)


def test_constant_rate_when_burstiness_is_infinite():
    assert arrival_times(4, 2, float("inf"), 0) == pytest.approx([0, 0.5, 1.0, 1.5])


def test_seed_changes_the_schedule_and_is_reproducible():
    a, b = arrival_times(50, 4, 1.0, 1), arrival_times(50, 4, 1.0, 1)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, arrival_times(50, 4, 1.0, 2))


@pytest.mark.parametrize(("n", "qps", "burst"), [(0, 1, 1), (5, 0, 1), (5, -1, 1), (5, 1, 0)])
def test_rejects_bad_arguments(n, qps, burst):
    with pytest.raises(ValueError):
        arrival_times(n, qps, burst, 0)


def test_vllm_08_client_sends_follow_its_random_dataset_draws():
    # The spot check's 1,000/2,000 run (seed 0, QwQ-32B's tokenizer): these sends put the last
    # request's end at 47.68 s, against the published duration of 47.71 s.
    sends = benchmark_serving_08_sends(50, 10.0, 0, 1000, 2000, 151643)
    assert sends[:5] == pytest.approx([0.0, 0.1196, 0.1258, 0.2357, 0.3468], abs=1e-4)
    assert sends[-1] == pytest.approx(3.8687, abs=1e-4)
    # The dataset's draws come first: the same seed without them is another schedule.
    assert not np.allclose(sends, arrival_times(50, 10.0, 1.0, 0))
    # ... and they depend on the tokenizer's vocabulary, which bounds the offsets drawn.
    assert not np.allclose(sends, benchmark_serving_08_sends(50, 10.0, 0, 1000, 2000, 32000))


def test_vllm_019_client_sends_are_rescaled_to_end_at_n_over_qps():
    sends = bench_serve_019_sends(4, 2.0, 0)
    draws = np.cumsum(np.random.RandomState(0).gamma(1.0, 0.5, size=4))
    assert sends == pytest.approx(draws * 2.0 / draws[-1])
    assert sends[0] > 0 and sends[-1] == pytest.approx(2.0)
    assert bench_serve_019_sends(500, 16.0, 42)[-1] == pytest.approx(31.25)


def test_benchmark_serving_08_sharegpt_sends_draw_nothing_before_the_gaps() -> None:
    """ShareGPT's sampling leaves NumPy's generator alone: the first request goes at once and the
    gaps are the seed's first gamma draws, not the random dataset's later ones."""
    sends = benchmark_serving_08_sharegpt_sends(200, 4.0, 0)
    gaps = np.random.RandomState(0).gamma(1.0, 0.25, size=199)
    assert sends[0] == 0.0 and np.allclose(np.diff(sends), gaps)
    assert not np.allclose(sends, benchmark_serving_08_sends(200, 4.0, 0, 213, 214, 128000))
