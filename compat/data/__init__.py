"""Data: the synthetic captioned-image stream, tar shards, and the streaming shard loader.

- :mod:`compat.data.synth` -- generate the phase-by-phase synthetic stream (``generate_stream``), realistic or
  disjoint shift.
- :mod:`compat.data.shift` -- measure a stream's vocabulary shift (new words, captions in earlier words only).
- :mod:`compat.data.shards` -- write deterministic tar shards; stream their raw samples.
- :mod:`compat.data.loader` -- expand shard specs and stream decoded samples and batches, resumably.
"""
