"""Graded tests of chapter 5's exercises: the bf16 crossover (ch05.1), the default-engine rule (ch05.2),
the bf16 linear layer (ch05.3).

The two rules are graded on timings and measurements written by hand, never on this machine's: a
rule is a function of its figures. The linear layer is graded on inputs whose bf16 and fp32 products
differ exactly (so the path it took shows), and against products computed here with torch directly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch05_inference_engine.bf16_matmul import (
    Bf16MatmulLinear,
    crossover_from_timings,
)
from chapters.ch05_inference_engine.engines import ACCURACY_TOLERANCE, MIN_SPEEDUP, pick

# ----------------------------------------------------------------------------- ch05.1: the crossover


@pytest.mark.exercise("ch05.1")
@pytest.mark.parametrize(
    ("timings", "crossover"),
    [
        # {rows: (fp32 µs, bf16 µs)}
        ({1: (10, 20), 2: (12, 18), 4: (15, 14), 8: (20, 12), 16: (30, 15)}, 4),  # bf16 wins from 4 on
        ({1: (5, 4), 2: (6, 5), 4: (8, 6)}, 1),  # wins everywhere: from the smallest count
        ({1: (10, 20), 2: (12, 18), 4: (15, 16)}, None),  # loses even at the largest: never
        ({1: (10, 9), 2: (10, 11), 4: (10, 8), 8: (10, 5)}, 4),  # a win at 1 does not count: it loses at 2
        ({1: (10, 30), 2: (10, 10), 4: (10, 9)}, 4),  # a tie is not a win
        ({64: (50, 20), 8: (12, 13), 16: (20, 15), 1: (3, 9)}, 16),  # the dict's order is not the rows' order
    ],
)
def test_the_crossover_is_the_smallest_count_from_which_bf16_wins_at_every_larger_one(timings, crossover) -> None:
    assert crossover_from_timings(timings) == crossover


@pytest.mark.exercise("ch05.1")
def test_a_single_measured_count_is_its_own_crossover_or_none() -> None:
    assert crossover_from_timings({32: (9.0, 4.5)}) == 32
    assert crossover_from_timings({32: (4.5, 9.0)}) is None


# ----------------------------------------------------------------------------- ch05.2: the default engine


def row(engine: str, precision: str, requests_per_s: float, accuracy: float) -> dict:
    return {"engine": engine, "precision": precision, "requests_per_s": requests_per_s, "accuracy": accuracy}


BASELINE = row("eager", "fp32", 100.0, 0.90)


@pytest.mark.exercise("ch05.2")
def test_the_fastest_candidate_that_is_accurate_enough_and_clearly_faster_serves() -> None:
    rows = [BASELINE, row("eager", "bf16", 150.0, 0.89), row("eager", "int8", 180.0, 0.895), row("tensorrt", "fp16", 130.0, 0.90)]
    assert pick(rows) == ("eager", "int8")


@pytest.mark.exercise("ch05.2")
def test_a_faster_candidate_that_loses_too_much_accuracy_is_passed_over() -> None:
    too_inaccurate = row("eager", "int8", 300.0, BASELINE["accuracy"] - ACCURACY_TOLERANCE - 0.01)
    within = row("eager", "bf16", 140.0, BASELINE["accuracy"] - ACCURACY_TOLERANCE + 0.005)
    assert pick([too_inaccurate, BASELINE, within]) == ("eager", "bf16")


@pytest.mark.exercise("ch05.2")
def test_a_candidate_within_the_noise_of_fp32_eager_does_not_replace_it() -> None:
    barely = row("eager", "bf16", BASELINE["requests_per_s"] * (MIN_SPEEDUP - 0.05), 0.92)
    assert pick([barely, BASELINE]) == ("eager", "fp32"), "not MIN_SPEEDUP times faster: keep the oracle's exact tokens"
    clearly = row("eager", "bf16", BASELINE["requests_per_s"] * (MIN_SPEEDUP + 0.05), 0.92)
    assert pick([barely, BASELINE, clearly]) == ("eager", "bf16")


@pytest.mark.exercise("ch05.2")
def test_with_no_eligible_candidate_or_fp32_alone_fp32_eager_serves() -> None:
    assert pick([BASELINE]) == ("eager", "fp32")
    slow = row("eager", "int8", 60.0, 0.95)
    inaccurate = row("eager", "bf16", 500.0, 0.10)
    assert pick([slow, inaccurate, BASELINE]) == ("eager", "fp32")


@pytest.mark.exercise("ch05.2")
def test_a_more_accurate_candidate_is_eligible_too() -> None:
    assert pick([BASELINE, row("tensorrt", "fp16", 200.0, 0.99)]) == ("tensorrt", "fp16")


# ----------------------------------------------------------------------------- ch05.3: bf16 from min_rows


ONE_PLUS = 1 + 2**-10  # exact in fp32; bf16 (8 bits of mantissa) rounds it to 1.0


def ones_layer(in_features: int = 4, out_features: int = 3, min_rows: int = 2) -> Bf16MatmulLinear:
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.fill_(1.0)
        linear.bias.fill_(0.5)
    return Bf16MatmulLinear(linear, min_rows)


@pytest.mark.exercise("ch05.3")
def test_below_min_rows_the_product_is_exact_fp32() -> None:
    layer = ones_layer(min_rows=2)
    out = layer(torch.full((1, 4), ONE_PLUS))
    assert out.dtype == torch.float32
    assert out.tolist() == [[4 * ONE_PLUS + 0.5] * 3], "one row, min_rows 2: fp32, nothing rounded"


@pytest.mark.exercise("ch05.3")
def test_from_min_rows_on_the_input_is_rounded_to_bf16_and_the_output_is_fp32() -> None:
    layer = ones_layer(min_rows=2)
    out = layer(torch.full((2, 4), ONE_PLUS))
    assert out.dtype == torch.float32, "the output stays fp32: the rest of the model is fp32"
    assert out.tolist() == [[4.5] * 3] * 2, "two rows: bf16, where 1 + 2^-10 is 1.0"


@pytest.mark.exercise("ch05.3")
def test_rows_are_every_token_of_a_batch_not_the_first_dimension() -> None:
    layer = ones_layer(min_rows=6)
    x = torch.full((2, 3, 4), ONE_PLUS)  # 2 sequences x 3 tokens: 6 rows
    assert layer(x).tolist() == [[[4.5] * 3] * 3] * 2
    assert ones_layer(min_rows=7)(x).tolist() == [[[4 * ONE_PLUS + 0.5] * 3] * 3] * 2


@pytest.mark.exercise("ch05.3")
def test_both_paths_match_torchs_own_products_on_random_weights() -> None:
    generator = torch.Generator().manual_seed(5)
    linear = nn.Linear(16, 8)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(8, 16, generator=generator))
        linear.bias.copy_(torch.randn(8, generator=generator))
    layer = Bf16MatmulLinear(linear, min_rows=4)
    small, large = torch.randn(3, 16, generator=generator), torch.randn(5, 16, generator=generator)
    with torch.no_grad():
        assert torch.equal(layer(small), F.linear(small, linear.weight, linear.bias))
        bf16 = F.linear(large.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float()
        torch.testing.assert_close(layer(large), bf16, rtol=2e-2, atol=2e-2)
        assert not torch.equal(layer(large), F.linear(large, linear.weight, linear.bias)), "5 rows >= 4: the bf16 path"
