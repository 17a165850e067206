"""Per-request sampling seeds of the server engines."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def derive_sampling_seed(seed: int, index: int, *, stream: int = 0) -> int:
    """A well-mixed per-request seed in [0, 2**31) from the call's seed, the request index and a stream (splitmix64).

    Neighbouring (seed, index) pairs give unrelated seeds, so step s + 1 never replays a sample of step s. `stream`
    is the data-parallel rank: replicas that draw the same (seed, index) still get unrelated samples.
    """
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 1 + int(stream) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFF
