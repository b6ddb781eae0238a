"""NOTE [Regions of the arena] on CUDA: a region of the device arena (a language model's
page pool is one) is held apart from the models, which come and go around it with
poisoned evictions, keeps its bytes and offset, and is refused clearly when it cannot
fit. The CPU tests' checks, on the device. Marked ``cuda``; skipped without a GPU."""

import pytest

from tests.integration.test_arena_regions import held_apart, refused

pytestmark = pytest.mark.cuda


def test_a_region_is_held_apart_from_the_models_on_cuda():
    held_apart("cuda")


def test_a_region_that_does_not_fit_is_refused_on_cuda():
    refused("cuda")
