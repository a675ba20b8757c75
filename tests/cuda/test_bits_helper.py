"""The GPU tests' bit-for-bit comparison (tests.cuda.gradients.assert_bits_equal) at every element
width the ops return, on the CPU: a GPU run once failed on equal float64 outputs because the helper
viewed 8-byte elements as int16."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.gradients import assert_bits_equal


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
def test_equal_values_pass_and_one_changed_bit_fails(dtype):
    a = (torch.arange(8, dtype=torch.float64) - 3.5).to(dtype)
    assert_bits_equal(a, a.clone())
    b = a.clone()
    b.view(torch.uint8)[b.element_size() * 5] ^= 1  # the lowest bit of element 5
    with pytest.raises(AssertionError, match="1 elements differ, first at 5"):
        assert_bits_equal(a, b)


def test_nan_positions_must_match_but_payloads_may_differ():
    a = torch.tensor([1.0, float("nan"), -2.0], dtype=torch.float64)
    b = a.clone()
    b.view(torch.int64)[1] ^= 1  # another NaN payload
    assert_bits_equal(a, b)
    with pytest.raises(AssertionError, match="NaN positions differ"):
        assert_bits_equal(a, torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64))


def test_minus_zero_is_not_zero():
    with pytest.raises(AssertionError, match="differ"):
        assert_bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
