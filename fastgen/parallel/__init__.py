"""Tensor parallelism: one replica over N processes (``tensor_parallel_size=N``).

- fastgen.parallel.shard: which heads, features and vocabulary rows each rank holds;
- fastgen.parallel.layers: the sharded layers' formats and the vocabulary-parallel embedding;
- fastgen.parallel.group: the process groups, the batch on the wire, starting the ranks;
- fastgen.parallel.replica: rank 0's model and the other ranks' loop.
"""
