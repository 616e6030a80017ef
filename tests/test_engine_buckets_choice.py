"""Which token buckets an engine pads its calls to: the finer list under lazy buckets (`jserve
serve`, which compiles them behind the served requests), the coarser one for a warm-up that waits."""

from __future__ import annotations

from jserve.core import buckets
from test_engine import make_engine, tiny  # noqa: F401 (a fixture)


def test_lazy_buckets_pad_to_the_finer_token_buckets(tiny):  # noqa: F811
    for lazy, expected in ((True, buckets.FINE_TOKEN_BUCKETS), (False, buckets.DEFAULT_TOKEN_BUCKETS)):
        engine = make_engine(tiny, lazy_buckets=lazy, max_num_batched_tokens=128)
        assert engine.runner.token_buckets == tuple(b for b in expected if b <= 128), lazy
    assert 48 in buckets.FINE_TOKEN_BUCKETS and 48 not in buckets.DEFAULT_TOKEN_BUCKETS
