"""Ray actors: target shards and the tensor-parallel target group behind one target replica."""
