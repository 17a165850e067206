"""Per-request seeds of the server engines."""

from megatron_gspo.rollout.server.seeds import derive_sampling_seed


def test_derived_seeds_are_distinct_and_stable():
    seeds = {derive_sampling_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400
    assert all(0 <= x < 2**31 for x in seeds)
    assert derive_sampling_seed(3, 5) == derive_sampling_seed(3, 5)
    assert derive_sampling_seed(3, 6) != derive_sampling_seed(4, 5)


def test_data_parallel_streams_are_distinct_and_stream_0_is_the_plain_seed():
    plain = {derive_sampling_seed(7, i) for i in range(64)}
    streams = [{derive_sampling_seed(7, i, stream=r) for i in range(64)} for r in range(4)]
    assert streams[0] == plain
    assert all(not (streams[a] & streams[b]) for a in range(4) for b in range(a + 1, 4))
