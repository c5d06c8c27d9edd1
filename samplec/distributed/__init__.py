"""samplec across processes: a program run on vocabulary slices held by the ranks of an `mx.distributed` group
(spec §7), and a vocabulary-parallel LM head for mlx-lm models. docs/distributed.md describes both."""
from samplec.distributed.lm_head import VocabParallelEmbedding, generate_sharded, shard_lm_head
from samplec.distributed.sharded import ShardedProgram, shard

__all__ = ["shard", "ShardedProgram", "shard_lm_head", "generate_sharded", "VocabParallelEmbedding"]
